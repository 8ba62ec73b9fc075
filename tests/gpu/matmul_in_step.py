"""A user-style step's matrix products against the same products timed alone, under three conditions.

    python tests/gpu/matmul_in_step.py PROFILE.json [--shapes FILE] [--ids D1,D3] [--iters 30]

For development shapes only (as tests/gpu/transformer_profile.py): one step of the module of
tests/gpu/transformer_check.py under ``torch.profiler`` with the ops' input shapes recorded; every
``aten::mm`` / ``aten::addmm`` product of the step (attention's are SDPA's own) is grouped by (m, k, n) with its
GPU time in the step. Each (m, k, n) is then timed alone with ``torch.mm`` on fresh bf16 inputs, each
condition in its own interleaved round, CUDA events around each call (the engine's ``host`` mode):

- ``copy``: a 256 MiB copy after each call (what ``calibrate compute`` does: caches hold nothing of
  the next call's inputs, and the copy leaves the cache full of written lines);
- ``read``: a 256 MiB read (a sum) after each call: the caches are flushed of the inputs but hold no
  written lines;
- ``b2b``: calls back to back, three input sets rotated.

Printed: per (m, k, n), the count in one step, the in-step median per call, each condition's median and
its ratio to the in-step time; last, the step's product time against each condition's sum (count x
median): the condition whose sum matches the step is the one calibration should measure under.
The model's own figure (``ComputeModel.matmul_seconds``, from PROFILE) is printed beside them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import transformer_check as tc  # noqa: E402

CONDITIONS = ("copy", "read", "b2b")


def product_shape(name: str, shapes) -> tuple[int, int, int] | None:
    """(m, k, n) of an aten::mm / aten::addmm call from its recorded input shapes."""
    if name == "aten::mm" and len(shapes) >= 2 and len(shapes[0]) == 2 and len(shapes[1]) == 2:
        (m, k), (_, n) = shapes[0], shapes[1]
        return m, k, n
    if name == "aten::addmm" and len(shapes) >= 3 and len(shapes[1]) == 2 and len(shapes[2]) == 2:
        (m, k), (_, n) = shapes[1], shapes[2]
        return m, k, n
    return None


def step_products(torch, shape) -> dict[tuple, list[float]]:
    """{(m, k, n): [count, seconds in one step]} of the module's step."""
    from torch.profiler import ProfilerActivity, profile
    with torch.device("cuda"):
        module = tc.build_module(shape, "none")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocabulary"], (shape["micro_batch"], shape["sequence"] + 1), generator=g)
    x, y = tokens[:, :-1].contiguous().cuda(), tokens[:, 1:].contiguous().cuda()
    opt = torch.optim.AdamW(module.parameters(), lr=6e-4, fused=True)

    def step():
        tc.one_step(torch, module, opt, x, y)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    out: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages(group_by_input_shape=True):
        mkn = product_shape(ev.key, ev.input_shapes)
        if mkn is None:
            continue
        dev = getattr(ev, "self_device_time_total", None)
        if dev is None:
            dev = ev.self_cuda_time_total
        out[mkn][0] += ev.count
        out[mkn][1] += dev / 1e6
    del module, opt
    torch.cuda.empty_cache()
    return dict(out)


def alone(torch, mkn, iters: int) -> dict[str, float]:
    """Median seconds of torch.mm at (m, k, n), bf16, under each condition, rounds interleaved."""
    m, k, n = mkn
    sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
             torch.randn(k, n, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
    src = torch.randn(1 << 27, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    between = {"copy": lambda: dst.copy_(src), "read": lambda: src.sum(), "b2b": lambda: None}
    samples = {c: [] for c in CONDITIONS}
    for r in range(iters // 5 + 2):
        for c in CONDITIONS:
            marks = []
            for i in range(5):
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                torch.mm(*sets[i % 3])
                b.record()
                between[c]()
                marks.append((a, b))
            torch.cuda.synchronize()
            if r >= 2:  # two warm-up rounds
                samples[c] += [a.elapsed_time(b) / 1e3 for a, b in marks]
    return {c: statistics.median(v) for c, v in samples.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="matmul_in_step.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="the profile python -m calibrate compute wrote on this machine")
    ap.add_argument("--shapes", default=str(tc.SHAPES), help="a shape declaration (development rows only)")
    ap.add_argument("--ids", default=None, help="development shape ids (default all of them)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per condition (default 30)")
    args = ap.parse_args(argv)
    shapes = tc.load_shapes(args.shapes, ("development",))
    if args.ids:
        want = set(args.ids.split(","))
        shapes = [s for s in shapes if s["id"] in want]
    import torch

    from calibrate.profile import Profile
    model = Profile.load(args.profile).compute
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # clocks up before anything is timed
        x @ x
    torch.cuda.synchronize()
    for shape in shapes:
        prods = step_products(torch, shape)
        print(f"\n== {shape['id']} ({shape['family']}): layers {shape['layers']} hidden {shape['hidden']} ffn "
              f"{shape['ffn']} seq {shape['sequence']} micro-batch {shape['micro_batch']}")
        print(f"{'m x k x n':>22} {'count':>5} {'step us':>9} " + " ".join(f"{c + ' us':>9} {'x':>5}" for c in CONDITIONS)
              + f" {'model us':>9} {'x':>5}")
        total = {c: 0.0 for c in CONDITIONS + ("step", "model")}
        for mkn, (count, secs) in sorted(prods.items(), key=lambda kv: -kv[1][1]):
            per = secs / count
            t = alone(torch, mkn, args.iters)
            mod = model.matmul_seconds(*mkn, 2)
            total["step"] += secs
            total["model"] += count * mod
            for c in CONDITIONS:
                total[c] += count * t[c]
            print(f"{' x '.join(map(str, mkn)):>22} {count:5d} {per * 1e6:9.1f} "
                  + " ".join(f"{t[c] * 1e6:9.1f} {t[c] / per:5.2f}" for c in CONDITIONS)
                  + f" {mod * 1e6:9.1f} {mod / per:5.2f}")
        print(f"{'sum (ms)':>22} {'':5} {total['step'] * 1e3:9.2f} "
              + " ".join(f"{total[c] * 1e3:9.2f} {total[c] / total['step']:5.2f}" for c in CONDITIONS)
              + f" {total['model'] * 1e3:9.2f} {total['model'] / total['step']:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
