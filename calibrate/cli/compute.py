"""``python -m calibrate compute``: measure the GPU's compute model into a profile.

    python -m calibrate compute --out h200.json                  # merge into h200.json (or the default profile)
    python -m calibrate compute --profile h200-nvlink --out my.json --dtypes bf16

Times, with CUDA events and the median of --iters runs on fresh random data
(a new set of inputs per shape, rotated over three copies so that no run reads
what the previous one left in L2): matmuls ``a @ b`` over a grid of shapes,
the causal attention core that executed plans run (``calibrate.attention``: the
probabilities kept, as the plans' memory model counts them) over sequence
lengths and head sizes,
a device-to-device copy (memory bandwidth); a GELU forward and backward,
torch's fused Adam and the masked embedding's forward and backward (the
bandwidths of the step's other memory-bound kernels, which move fewer bytes a
second than a copy); and a one-element kernel (launch cost). Writes the
profile's ``compute`` section (``calibrate.compute``): the collective tiers of
the base profile are kept.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
from pathlib import Path

from calibrate.cli import command_parser
from calibrate.attention import attention_layer, causal_attention
from calibrate.embedding import masked_embedding
from calibrate.compute import Band, ComputeModel
from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.optional import require_torch
from calibrate.profile import DEFAULT_PROFILE, Profile

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
SQUARES = (256, 512, 1024, 2048, 4096, 8192)
TALL = (256, 512, 1024, 2048)  # widths s of token-major transformer shapes (8s, s, s), (8s, s, 3s), (8s, s, 4s), (8s, 4s, s)
SEQS = (256, 512, 1024, 2048, 4096)
HEAD_DIMS = (64, 128)
PEAKS = {"NVIDIA H200": {2: 989e12, 4: 67e12}, "NVIDIA H100": {2: 989e12, 4: 67e12},
         "NVIDIA A100": {2: 312e12, 4: 19.5e12}}


OP_SOURCES = {"elementwise": "bf16 GELU forward and backward, 128 Mi elements",
              "optimizer": "fused Adam on 256 Mi fp32 elements",
              "embedding": "masked embedding forward, 8 Ki tokens x 32 Ki rows x 4 Ki, bytes as the step model counts",
              "embedding_backward": "its backward, bytes as the step model counts"}


def parser() -> argparse.ArgumentParser:
    ap = command_parser("python -m calibrate compute", __doc__)
    ap.add_argument("--out", required=True, help="profile JSON to write (merged into if it already is a profile)")
    ap.add_argument("--profile", default=None,
                    help=f"base profile whose tiers are kept (default: --out if it exists, else {DEFAULT_PROFILE})")
    ap.add_argument("--dtypes", default="bf16,fp32", help="element types, of bf16, fp16, fp32 (default bf16,fp32)")
    ap.add_argument("--iters", type=int, default=20, help="timed runs per shape (default 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--merge", metavar="PROFILE.json",
                    help="measure nothing: copy the compute section of PROFILE.json (measured earlier) into --out "
                         "(e.g. an embedded profile), the rest of --out untouched")
    return ap


def progress(msg: str) -> None:
    print(f"[compute] {msg}", file=sys.stderr, flush=True)


def _time(torch, fn, iters: int, warmup: int, between=None) -> float:
    """Median seconds of ``fn(i)`` between CUDA events. Without ``between``, each call alone after
    a synchronisation; with it, the calls issued without waiting for one another and
    ``between()`` (memory-bound work) after each, as a training step interleaves its matmuls with
    other kernels: a call alone starts on an idle GPU (1 H200, 2026-11-23: 8192 x 2048 x 6144 bf16
    took 282 us so, 261 us between copies), and matmuls back to back with nothing between run
    slower than in the step."""
    for i in range(warmup):
        fn(i)
        if between:
            between()
    torch.cuda.synchronize()
    marks = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        if between:
            between()
        else:
            b.synchronize()
        marks.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) / 1e3 for a, b in marks)


def measure_matmul(torch, dtype, device, iters, warmup) -> list[tuple[float, float, tuple]]:
    """Squares, and the token-major shapes of a transformer's linear layers (QKV, the MLP's two,
    the projection) at several widths, each timed between copies of 256 MiB (``_time``)."""
    shapes = [(s, s, s) for s in SQUARES] + [(8 * s, s, f * s) for s in TALL for f in (1, 3, 4)] + \
        [(8 * s, 4 * s, s) for s in TALL]
    src = torch.randn(1 << 27, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    out = []
    for m, k, n in shapes:
        sets = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
                for _ in range(3)]
        t = _time(torch, lambda i: torch.mm(*sets[i % 3]), iters, warmup, between=lambda: dst.copy_(src))
        out.append((2.0 * m * k * n, t, (m, k, n)))
        progress(f"matmul {m}x{k}x{n} {dtype}: {t * 1e6:.1f} us, {2.0 * m * k * n / t / 1e12:.1f} TFLOP/s")
        del sets
    return out


def measure_attention(torch, dtype, device, iters, warmup) -> list[tuple]:
    """Per shape (b, h, s, d): (flops, core forward seconds, shape, core backward seconds, layer
    forward seconds, layer backward seconds). A backward is the time of forward and backward
    together (autograd, the probabilities kept) less the forward's; the layer
    (``calibrate.attention.attention_layer``) is the core with the fused QKV split into heads
    before it and the output made token-major after it, as executed plans run it."""
    out = []
    batch, heads = 4, 16
    for d in HEAD_DIMS:
        for s in SEQS:
            sets = [tuple(torch.randn(batch, heads, s, d, device=device, dtype=dtype, requires_grad=True)
                          for _ in range(3)) for _ in range(3)]
            grad = torch.randn(batch, heads, s, d, device=device, dtype=dtype)
            with torch.no_grad():
                t = _time(torch, lambda i: causal_attention(torch, *sets[i % 3]), iters, warmup)
            both = _time(torch, lambda i: causal_attention(torch, *sets[i % 3]).backward(grad), iters, warmup)
            del sets
            xs = [torch.randn(batch * s, 3 * heads * d, device=device, dtype=dtype, requires_grad=True)
                  for _ in range(3)]
            gl = grad.transpose(1, 2).reshape(batch * s, heads * d)
            with torch.no_grad():
                lt = _time(torch, lambda i: attention_layer(torch, xs[i % 3], s, d), iters, warmup)
            lboth = _time(torch, lambda i: attention_layer(torch, xs[i % 3], s, d).backward(gl), iters, warmup)
            flops = 4.0 * batch * heads * s * s * d
            out.append((flops, t, (batch, heads, s, d), max(both - t, t), lt, lboth - lt))
            progress(f"attention b={batch} h={heads} s={s} d={d} {dtype}: core {t * 1e6:.1f} us forward, "
                     f"{(both - t) * 1e6:.1f} us backward; layer {lt * 1e6:.1f} / {(lboth - lt) * 1e6:.1f} us")
            del xs, grad, gl
    return out


def measure_memory(torch, device, iters, warmup) -> float:
    n = 1 << 28  # 256 Mi fp32 = 1 GiB per buffer
    src = [torch.rand(n, device=device) for _ in range(2)]
    dst = torch.empty(n, device=device)
    t = _time(torch, lambda i: dst.copy_(src[i % 2]), iters, warmup)
    return 2 * n * 4 / t


def measure_elementwise(torch, device, iters, warmup) -> float:
    """Bytes per second of a GELU forward and backward in bf16 on 128 Mi elements (read 2 + write 2
    bytes, then read 4 + write 2 an element): pointwise work computed in fp32, as a transformer's
    elementwise kernels are, where a plain addition runs at a copy's speed and is not typical."""
    n = 1 << 27
    x, g = (torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(2))
    gelu, back = torch.nn.functional.gelu, torch.ops.aten.gelu_backward
    t = _time(torch, lambda i: (gelu(x), back(g, x)), iters, warmup)
    return 10 * n / t


def measure_optimizer(torch, device, iters, warmup) -> float:
    """Bytes per second of torch's fused Adam on one fp32 weight of 256 Mi elements (reads the
    weight, its gradient and the two moments, writes the weight and the moments: 28 bytes each)."""
    n = 1 << 28
    w = torch.nn.Parameter(torch.randn(n, device=device))
    w.grad = torch.randn(n, device=device)
    opt = torch.optim.Adam([w], lr=1e-3, fused=True)
    t = _time(torch, lambda i: opt.step(), iters, warmup)
    return 28 * n / t


def measure_embedding(torch, device, iters, warmup) -> tuple[float, float]:
    """Bytes per second of the masked embedding (``calibrate.embedding``), forward and backward, in
    bf16: 8 Ki tokens, 32 Ki rows of 4 Ki, counted as the step model counts them (forward 4 passes
    over the output; backward 4 over the output and 1 over the weight). Its kernels are short, so
    the calls run back to back as in a step (timed alone, each would wait for its launch), each
    backward into a fresh weight gradient (no accumulation)."""
    t, rows, hidden = 8192, 32768, 4096
    w = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    ids = [torch.randint(0, rows, (t,), device=device) for _ in range(3)]
    grad = torch.randn(t, hidden, device=device, dtype=torch.bfloat16)

    def both(i):
        w.grad = None
        masked_embedding(torch, ids[i % 3], w, 0).backward(grad)

    with torch.no_grad():
        f = _time(torch, lambda i: masked_embedding(torch, ids[i % 3], w, 0), iters, warmup, between=lambda: None)
    fb = _time(torch, both, iters, warmup, between=lambda: None)
    return 4 * t * hidden * 2 / f, (4 * t * hidden + rows * hidden) * 2 / max(fb - f, 1e-9)


def measure_launch(torch, device, iters, warmup) -> float:
    x = torch.zeros(1, device=device)
    return _time(torch, lambda i: x.add_(1.0), max(iters, 50), warmup)


def merge(src: str, out: str) -> Path:
    """--out's JSON with the compute section of ``src`` (both profiles; nothing else changes)."""
    measured = Profile.load(src).compute
    if measured is None:
        raise UserError(f"{src} has no compute section: measure one with python -m calibrate compute --out {src}")
    Profile.load(out)  # --out must be a profile
    data = read_json(out, "profile", "give a profile JSON as --out")
    data["compute"] = measured.to_dict()
    return write_json(out, data, "profile")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.merge:
        print(f"wrote the compute section of {args.merge} into {merge(args.merge, args.out)}")
        return 0
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in names if d not in DTYPES]
    if bad or not names:
        raise UserError(f"unknown --dtypes {','.join(bad) or args.dtypes!r}: use some of {', '.join(DTYPES)}")
    if args.iters < 3 or args.warmup < 0:
        raise UserError("--iters must be at least 3 and --warmup non-negative")
    out = Path(args.out)
    base = args.profile or (str(out) if out.exists() else DEFAULT_PROFILE)
    profile = Profile.load(base)
    torch = require_torch()
    if not torch.cuda.is_available():
        raise UserError("python -m calibrate compute measures a GPU but torch sees no CUDA device: run it on a GPU machine")
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device)
    progress(f"{gpu}, torch {torch.__version__}; base profile {profile.name}")
    matmul, attention, attention_bwd, sources, copies, copies_bwd = {}, {}, {}, {}, {}, {}
    for name in names:
        dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[name])
        size = DTYPES[name]
        peak = next((v[size] for k, v in PEAKS.items() if gpu.startswith(k)), None)
        mm = measure_matmul(torch, dtype, device, args.iters, args.warmup)
        att = measure_attention(torch, dtype, device, args.iters, args.warmup)
        best = max(f / t for f, t, _ in mm)
        matmul[str(size)] = Band(peak or best, tuple(sorted((f, t) for f, t, _ in mm)))
        attention[str(size)] = Band(peak or best, tuple(sorted((b * h * s * s, t) for _, t, (b, h, s, _), *_ in att)),
                                    "scores")
        attention_bwd[str(size)] = Band(peak or best, tuple(sorted((b * h * s * s, tb)
                                                                   for _, _, (b, h, s, _), tb, _, _ in att)), "scores")
        copies[str(size)], copies_bwd[str(size)] = (
            Band(peak or best, tuple(sorted((b * h * s * d, max(layer - core, 1e-7)) for b, h, s, d, core, layer in pairs)),
                 "elements")
            for pairs in ([(*shape, t, lt) for _, t, shape, _, lt, _ in att],
                          [(*shape, tb, lb) for _, _, shape, tb, _, lb in att]))
        sources[f"matmul.{size}"] = f"measured ({name}, {len(mm)} shapes, best {best / 1e12:.0f} TFLOP/s)"
        sources[f"attention.{size}"] = f"measured ({name}, causal softmax(QK^T)V, probabilities kept, {len(att)} shapes)"
        sources[f"attention_backward.{size}"] = f"measured ({name}, autograd backward of the same core, {len(att)} shapes)"
        sources[f"attention_copies.{size}"] = (f"measured ({name}, the attention layer's time less its core's, "
                                               f"forward and backward, {len(att)} shapes)")
    mem = measure_memory(torch, device, args.iters, args.warmup)
    ops = {"elementwise": measure_elementwise(torch, device, args.iters, args.warmup),
           "optimizer": measure_optimizer(torch, device, args.iters, args.warmup)}
    ops["embedding"], ops["embedding_backward"] = measure_embedding(torch, device, args.iters, args.warmup)
    launch = measure_launch(torch, device, args.iters, args.warmup)
    sources.update(memory_Bps=f"measured: device copy of 1 GiB, {mem / 1e9:.0f} GB/s read+write",
                   **{f"op_Bps.{k}": f"measured: {OP_SOURCES[k]}, {v / 1e9:.0f} GB/s" for k, v in ops.items()},
                   launch_s=f"measured: one-element kernel, {launch * 1e6:.1f} us")
    stamp = _dt.datetime.now().isoformat(timespec="seconds")
    profile.compute = ComputeModel(
        source=f"python -m calibrate compute on {gpu}, torch {torch.__version__}, {stamp}; medians of {args.iters} runs",
        kind="measured", launch_s=launch, memory_Bps=mem, matmul=matmul, attention=attention, sources=sources,
        attention_backward=attention_bwd, attention_copies=copies, attention_copies_backward=copies_bwd,
        op_Bps=ops)
    path = profile.save(out)
    progress(f"memory {mem / 1e9:.0f} GB/s (copy), " + ", ".join(f"{v / 1e9:.0f} GB/s ({k})" for k, v in ops.items())
             + f", launch {launch * 1e6:.1f} us")
    print(f"wrote the compute section of {profile.name} to {path}")
    return 0
