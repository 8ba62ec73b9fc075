"""Causal SDPA timed on Q, K, V laid out two ways: contiguous (batch, heads, sequence, head_dim), and as
users' modules hand them over, the transposed view of a (batch, sequence, heads, head_dim) tensor
(nanoGPT's split of the fused QKV, Hugging Face Llama's q_proj(x).view(b, s, h, d).transpose(1, 2)).

    python tests/gpu/sdpa_layout.py [--iters 10]

Prints per shape the forward and the backward (forward + backward less forward) of each layout, as
``calibrate compute`` times them (the engine, a 256 MiB copy after each call, the two arms of a layout
interleaved), and the ratio. A development probe: the shapes are development D1's and D3's attention and
two of the calibration grid.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = ((32, 16, 16, 1024, 64), (8, 16, 8, 2048, 128), (16, 16, 16, 1024, 64), (4, 32, 8, 4096, 128))


def tensors(torch, layout: str, b, h, kv, s, d):
    def one(heads):
        if layout == "bshd":
            leaf = torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            return leaf, leaf.transpose(1, 2)
        leaf = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return leaf, leaf
    return one(h), one(kv), one(kv)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sdpa_layout.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    import torch

    from calibrate.cli.compute import _forward_and_both, copy_256mib, sdpa_call
    between = copy_256mib(torch, "cuda")
    print(f"{'b h kv s d':>22} {'layout':>6} {'fwd us':>8} {'bwd us':>8}")
    for shape in SHAPES:
        res = {}
        for layout in ("bhsd", "bshd"):
            sets = [tensors(torch, layout, *shape) for _ in range(3)]
            b, h, kv, s, d = shape
            grad = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) if layout == "bshd"
                    else torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16))

            def fwd(i):
                return sdpa_call(torch, *(v for _, v in sets[i % 3]))

            def both(i):
                for leaf, _ in sets[i % 3]:
                    leaf.grad = None
                sdpa_call(torch, *(v for _, v in sets[i % 3])).backward(grad)

            f, fb = _forward_and_both(torch, fwd, both, args.iters, 2, between)
            res[layout] = (f, fb - f)
            print(f"{' '.join(map(str, shape)):>22} {layout:>6} {f * 1e6:8.1f} {(fb - f) * 1e6:8.1f}")
        r = [res["bshd"][i] / res["bhsd"][i] for i in (0, 1)]
        print(f"{'':>22} {'ratio':>6} {r[0]:8.2f} {r[1]:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
