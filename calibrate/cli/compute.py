"""``python -m calibrate compute``: measure the GPU's compute model into a profile.

    python -m calibrate compute --out h200.json                  # merge into h200.json (or the default profile)
    python -m calibrate compute --profile h200-nvlink --out my.json --dtypes bf16
    python -m calibrate compute declare --out heldout.json       # held-out shapes, before development
    python -m calibrate compute evaluate --heldout heldout.json --profile my.json --out eval.json

Times, with CUDA events through the measurement engine (``calibrate.measure``) and the
median of --iters runs (or of three batches of them) on fresh random data
(a new set of inputs per shape, rotated over three copies so that no run reads
what the previous one left in L2): matmuls ``a @ b`` over a grid of shapes,
the causal attention core that executed plans run (``calibrate.attention``: the
probabilities kept, as the plans' memory model counts them) over sequence
lengths and head sizes, torch's fused causal attention
(``scaled_dot_product_attention``, is_causal, grouped-query heads by enable_gqa=True) forward and
backward over a grid of sequence lengths 512..16384, head sizes 64 and 128 and (heads, kv_heads)
from 8 to 64 heads and 1 to all K/V heads, each point with the backend it ran on (flash,
efficient, cudnn or math: the aten op the dispatcher called, read with torch's profiler); a
device-to-device copy (memory bandwidth); a GELU forward and backward,
torch's fused Adam and the masked embedding's forward and backward (the
bandwidths of the step's other memory-bound kernels, which move fewer bytes a
second than a copy); one-element kernels queued behind a matmul (a kernel's fixed cost in a step); the
host's cost of each of apply's paths (``host_s``: a small Llama block issued on a process group of one, the
multi-device paths among 2 GPUs where 2 are visible, else the tensor paths under torch's fake process group of 2,
``calibrate.modulehost.reference_host``) and compute's slowdown beside communication (``overlap``: a
stream of a block's products beside NCCL collectives between 2 GPUs where 2 are visible, else beside a copy, said
in the profile: ``calibrate.overlap``); multi-GPU planning needs both. Writes the
profile's ``compute`` section (``calibrate.compute``) and its ``device`` section (the GPU's
name, total memory, and usable memory: at the end of the run, once torch's cache is released,
the free memory plus what torch still holds, i.e. the total less this process's CUDA context
grown by the kernels a step loads, and less other processes' memory): the collective tiers of
the base profile are kept.

How long: on one H100 or H200, the SDPA grid (132 bf16 points, 18 fp32) adds about half a
minute at --iters 10 to the rest (matmuls, attention core, bandwidths), estimated from its
flops at the measured rates; each run prints its own times per part.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path

from calibrate.cli import command_parser
from calibrate.attention import attention_layer, causal_attention
from calibrate.embedding import masked_embedding
from calibrate.layers import pieces as layer_pieces
from calibrate.compute import Band, ComputeModel, SdpaPoint, SdpaTable, fit_layer_piece
from calibrate.computeeval import Grid
from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.measure.torcharm import TorchArm, medians, timing
from calibrate.modulehost import reference_host
from calibrate.overlap import measure_overlap
from calibrate.optional import require_torch
from calibrate.profile import DEFAULT_PROFILE, Device, Profile
from calibrate.usermodule import REFERENCE

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
SQUARES = (256, 512, 1024, 2048, 4096, 8192)
TALL = (256, 512, 1024, 2048)  # widths s of token-major transformer shapes (8s, s, s), (8s, s, 3s), (8s, s, 4s), (8s, 4s, s)
SEQS = (256, 512, 1024, 2048, 4096)
HEAD_DIMS = (64, 128)
SDPA_TOKENS = 16384  # batch x sequence of every SDPA point: a training micro-batch's tokens
LAYER_SIZES = ((16384, 4096), (4096, 1024))  # (tokens, hidden) of the layer pieces: the reference and 16x fewer
LAYER_QUEUE = 4  # calls of a layer piece timed together, between the cover matmuls (measure_layers)
COVER_MATMULS = 4  # 8192^3 bf16 matmuls after them (~6 ms on an H100): longer than the host takes to issue the next
# (heads, kv_heads) per element size; bf16 over sequences 512..16384, fp32 (no flash kernel: a slower
# backend, maybe one that keeps the s^2 scores) over 512..2048
SDPA_HEADS = {2: ((8, 8), (8, 1), (16, 16), (16, 2), (16, 1), (32, 32), (32, 4), (32, 1), (64, 64), (64, 8), (64, 1)),
              4: ((8, 8), (32, 32), (32, 4))}
SDPA_SEQS = {2: (512, 1024, 2048, 4096, 8192, 16384), 4: (512, 1024, 2048)}
SDPA_OPS = (("cudnn", ("_scaled_dot_product_cudnn", "cudnn")),  # cudnn first: its kernel names say "flash" too
            ("flash", ("_scaled_dot_product_flash", "flash_fwd", "flash_bwd", "pytorch_flash")),
            ("efficient", ("_scaled_dot_product_efficient", "_efficient_attention", "fmha_cutlass")),
            ("math", ("_scaled_dot_product_attention_math",)))
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
                    help="measure nothing: copy the compute and device sections of PROFILE.json (measured earlier) "
                         "into --out (e.g. an embedded profile), the rest of --out untouched")
    ap.add_argument("--sections", metavar="NAME[,NAME..]",
                    help="with --merge: only these parts of the compute section (e.g. sdpa,layer_s,layer_call_s), "
                         "--out's other parts and its device section kept")
    return ap


def progress(msg: str) -> None:
    print(f"[compute] {msg}", file=sys.stderr, flush=True)


def _time(torch, fn, iters: int, warmup: int, between=None) -> float:
    """Median seconds of ``fn(i)`` between CUDA events (``calibrate.measure.torcharm``). Without
    ``between``, ``iters`` calls each alone after a synchronisation; with it, three batches of calls
    issued without waiting for one another (``iters`` calls in all) and ``between()`` (memory-bound
    work) after each, as a training step interleaves its matmuls with other kernels, the median of the
    batches' mean call: a call alone starts on an idle GPU (1 H200, 2026-11-23: 8192 x 2048 x 6144 bf16
    took 282 us so, 261 us between copies), and matmuls back to back with nothing between run slower
    than in the step."""
    arm = [("call", lambda: TorchArm(torch, "cuda", fn, between))]
    return medians(torch, arm, timing(iters, warmup, back_to_back=between is not None))["call"]


def matmul_shapes() -> list[tuple[int, int, int]]:
    """(m, k, n) of the matmuls development measures."""
    return [(s, s, s) for s in SQUARES] + [(8 * s, s, f * s) for s in TALL for f in (1, 3, 4)] + \
        [(8 * s, 4 * s, s) for s in TALL]


def development_grid() -> Grid:
    """Every shape this command measures (``calibrate.computeeval``: evaluation holds out others)."""
    sdpa = tuple((SDPA_TOKENS // s, h, kv, s, d) for size in SDPA_HEADS for d in HEAD_DIMS
                 for h, kv in SDPA_HEADS[size] for s in SDPA_SEQS[size])
    return Grid(tuple(matmul_shapes()), sdpa, LAYER_SIZES)


def copy_256mib(torch, device):
    """A copy of 256 MiB to issue after each timed matmul and SDPA call: the caches hold none of the
    next call's inputs, as in a training step where other work runs between them."""
    src = torch.randn(1 << 27, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def measure_matmul(torch, dtype, device, iters, warmup) -> list[tuple[float, float, tuple]]:
    """Squares, and the token-major shapes of a transformer's linear layers (QKV, the MLP's two,
    the projection) at several widths, each timed between copies of 256 MiB (``_time``)."""
    shapes = matmul_shapes()
    between = copy_256mib(torch, device)
    out = []
    for m, k, n in shapes:
        sets = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
                for _ in range(3)]
        t = _time(torch, lambda i: torch.mm(*sets[i % 3]), iters, warmup, between=between)
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


def sdpa_backend(names) -> str:
    """The SDPA backend that ran, from the names of the ops and kernels a profiler saw during one
    call (the dispatcher's aten op ``aten::_scaled_dot_product_<backend>...``, or its kernels)."""
    names = [n.lower() for n in names]
    for backend, marks in SDPA_OPS:
        if any(m in n for n in names for m in marks):
            return backend
    return "math"  # no fused op: the composite of matmuls and a softmax


def sdpa_call(torch, q, k, v):
    """Causal SDPA as users call it; K/V heads fewer than Q's shared through enable_gqa."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=k.shape[1] != q.shape[1])


def fresh_backward(torch, qkv, grad) -> None:
    """Forward and backward into fresh gradients: a step's Q, K and V gradients flow on to the QKV
    projection, and are not added into earlier ones (which would cost a pass over each)."""
    for t in qkv:
        t.grad = None
    sdpa_call(torch, *qkv).backward(grad)


SDPA_ROUNDS = 5  # interleaved rounds of the forward and the forward + backward arms


def _forward_and_both(torch, fwd, both, iters, warmup, between) -> tuple[float, float]:
    """Median seconds of ``fwd(i)`` and of ``both(i)``, two arms interleaved in SDPA_ROUNDS rounds of
    back-to-back calls with ``between()`` after each: a slow spell of the device falls on both arms
    alike instead of on the one timed during it (one H100, 2026-11-27: a backward timed after its
    forward came out at 930 us in one calibration and 385 and 437 us in two others)."""
    arms = [(n, lambda f=f: TorchArm(torch, "cuda", f, between)) for n, f in (("f", fwd), ("fb", both))]
    t = medians(torch, arms, timing(iters, warmup, back_to_back=True, rounds=SDPA_ROUNDS))
    return t["f"], t["fb"]


def which_backend(torch, q, k, v, grad) -> str:
    """The backend of one forward and backward, read from torch's profiler (host ops only)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sdpa_call(torch, q, k, v).backward(grad)
    return sdpa_backend(e.name for e in prof.events())


def measure_sdpa(torch, dtype, size, device, iters, warmup) -> list[SdpaPoint]:
    """Causal SDPA per (head_dim, heads, kv_heads, sequence) of the grid (batch = SDPA_TOKENS /
    sequence), timed as the matmuls are (calls back to back, a 256 MiB copy after each, fresh
    inputs rotated over three sets): the forward with autograd on (as in training), and forward and
    backward together, the backward being their difference, the two interleaved
    (``_forward_and_both``). A shape that does not fit is skipped."""
    between = copy_256mib(torch, device)
    out = []
    for d in HEAD_DIMS:
        for heads, kv in SDPA_HEADS[size]:
            for s in SDPA_SEQS[size]:
                b = SDPA_TOKENS // s
                try:
                    sets = [(torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True),
                             *(torch.randn(b, kv, s, d, device=device, dtype=dtype, requires_grad=True)
                               for _ in range(2))) for _ in range(3)]
                    grad = torch.randn(b, heads, s, d, device=device, dtype=dtype)
                    backend = which_backend(torch, *sets[0], grad)
                    fwd, both = _forward_and_both(torch, lambda i: sdpa_call(torch, *sets[i % 3]),
                                                  lambda i: fresh_backward(torch, sets[i % 3], grad), iters,
                                                  warmup, between)
                except torch.cuda.OutOfMemoryError:
                    progress(f"sdpa b={b} h={heads} kv={kv} s={s} d={d} {dtype}: out of memory, skipped")
                    sets = grad = None
                    torch.cuda.empty_cache()
                    continue
                del sets, grad
                out.append(SdpaPoint(b, heads, kv, s, d, fwd, max(both - fwd, fwd), backend))
                flops = 2.0 * b * heads * s * s * d
                progress(f"sdpa b={b} h={heads} kv={kv} s={s} d={d} {dtype} ({backend}): {fwd * 1e6:.1f} us forward "
                         f"({flops / fwd / 1e12:.0f} TFLOP/s causal), {(both - fwd) * 1e6:.1f} us backward")
    return out


def device_memory(torch, device, free_at_start: int) -> Device:
    """The GPU's name, total and usable memory (usable: the rule in this module's docstring)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    usable = min(total, free + torch.cuda.memory_reserved(device))
    name = torch.cuda.get_device_name(device)
    return Device(name, int(total), int(usable),
                  f"measured by python -m calibrate compute: torch.cuda.mem_get_info's total; usable = its free "
                  f"memory at the end of the run after torch.cuda.empty_cache() plus torch's reserved "
                  f"({usable / 2**30:.2f} GiB; {free_at_start / 2**30:.2f} GiB free when the run started, "
                  f"before the kernels it loaded)")


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


def layer_piece_arm(torch, device, fn, cover) -> TorchArm:
    """The engine's arm for a memory-bound piece of a user's step (``calibrate.layers``) as a step runs it:
    a timed call is ``LAYER_QUEUE`` calls of ``fn``, and ``COVER_MATMULS`` long matmuls of ``cover`` (an
    8192^2 bf16 matrix) run untimed after each (``TorchArm``'s ``between``): the host issues the next calls
    while the matmuls run, so they wait in the queue and run back to back on the GPU, at the GPU's pace, not
    at the host's pace of issuing them, and start with the matmuls' data in the caches, not their own. Its
    seconds per call are ``LAYER_QUEUE`` pieces' (divide by it). Development (``measure_layers``) and the
    confirmatory evaluation (``calibrate compute evaluate``) time the pieces through it alike."""
    def matmuls():
        for _ in range(COVER_MATMULS):
            torch.mm(cover, cover)

    def run(i):
        for _ in range(LAYER_QUEUE):
            fn()
    return TorchArm(torch, device, run, matmuls)


def measure_layers(torch, device, iters, warmup) -> tuple[dict, dict]:
    """(seconds per element, seconds per call), forward and backward, of each memory-bound piece of a user's
    step (``calibrate.layers``), from its times at ``LAYER_SIZES`` (``calibrate.compute.fit_layer_piece``),
    each timed through ``layer_piece_arm`` (two arms, forward and forward plus backward, interleaved in
    three rounds of back-to-back batches, the median of each: one round's glitch drops out). The backward is
    the forward plus backward less the forward. One rate per element from the reference size alone
    under-predicted the smaller of the confirmatory sizes by 4-11% (one H100, 2026-11-27)."""
    cover = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    times: dict = {}
    for tokens, hidden in LAYER_SIZES:
        for kind, (elems, fwd, both) in layer_pieces(torch, device, tokens, hidden, max(1, hidden // 128)).items():
            arms = [(n, lambda f=f: layer_piece_arm(torch, device, f, cover)) for n, f in (("f", fwd), ("fb", both))]
            t = medians(torch, arms, timing(3 * iters, max(warmup, 3), back_to_back=True))
            f = t["f"] / LAYER_QUEUE
            times.setdefault(kind, []).append((elems, f, max(t["fb"] / LAYER_QUEUE - f, 0.0)))
        torch.cuda.empty_cache()
    per, call = {}, {}
    for kind, rows in times.items():
        (cf, pf), (cb, pb) = (fit_layer_piece([(n, r[k]) for n, *r in rows]) for k in (0, 1))
        per[kind], call[kind] = (pf, pb), (cf, cb)
    return per, call


LAUNCH_QUEUE = 100  # one-element kernels behind the matmul in measure_launch


def measure_launch(torch, device, iters, warmup) -> float:
    """A kernel's fixed cost inside a step: a long matmul (8192^3 bf16, over a millisecond) followed by
    LAUNCH_QUEUE one-element kernels, less the matmul alone (two arms interleaved, calls back to back),
    per kernel: issued while the matmul runs, the small kernels wait in the queue and run back to back,
    as a step's small kernels run behind its large ones. Timed alone after a synchronisation, one such
    kernel waits for its own launch (20-43 us on one H100 over seven calibrations, 2026-11-25..27),
    which no kernel of a step issued ahead of the GPU pays."""
    x = torch.zeros(1, device=device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def queued(i):
        torch.mm(a, a)
        for _ in range(LAUNCH_QUEUE):
            x.add_(1.0)

    arms = [(n, lambda f=f: TorchArm(torch, "cuda", f, lambda: None))
            for n, f in (("matmul", lambda i: torch.mm(a, a)), ("queued", queued))]
    t = medians(torch, arms, timing(3 * iters, warmup, back_to_back=True))
    return max(t["queued"] - t["matmul"], 0.0) / LAUNCH_QUEUE


def merge(src: str, out: str, sections: tuple[str, ...] = ()) -> Path:
    """--out's JSON with the compute section of ``src``, and its device section if it has one (both
    profiles; nothing else changes); with ``sections``, only those keys of the compute section (and their
    ``sources`` entries), the rest of --out's compute section kept."""
    source = Profile.load(src)
    measured = source.compute
    if measured is None:
        raise UserError(f"{src} has no compute section: measure one with python -m calibrate compute --out {src}")
    Profile.load(out)  # --out must be a profile
    data = read_json(out, "profile", "give a profile JSON as --out")
    new = measured.to_dict()
    if not sections:
        data["compute"] = new
        if source.device is not None:
            data["device"] = source.device.to_dict()
        return write_json(out, data, "profile")
    parts = [k for k in new if k not in ("kind", "source", "sources")]
    bad = [k for k in sections if k not in parts]
    if bad:
        raise UserError(f"{src}'s compute section has no {', '.join(bad)} to merge: give --sections of "
                        f"{', '.join(parts)}")
    if data.get("compute") is None:
        raise UserError(f"{out} has no compute section to merge {', '.join(sections)} into: leave out --sections")
    compute = data["compute"]
    compute.update({k: new[k] for k in sections})
    compute["sources"] = {**{n: v for n, v in compute.get("sources", {}).items() if n.split(".")[0] not in sections},
                          **{n: v for n, v in new.get("sources", {}).items() if n.split(".")[0] in sections}}
    compute["source"] = f"{compute.get('source', '')}; {', '.join(sections)} from {measured.source}"
    Profile.from_dict(data)  # the merged profile validates before it is written
    return write_json(out, data, "profile")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.sections and not args.merge:
        raise UserError("--sections picks parts of a --merge: give --merge PROFILE.json too, or leave it out")
    if args.merge:
        parts = tuple(k.strip() for k in (args.sections or "").split(",") if k.strip())
        print(f"wrote {', '.join(parts) or 'the compute section'} of {args.merge} into "
              f"{merge(args.merge, args.out, parts)}")
        return 0
    started = time.perf_counter()
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
    free_at_start = torch.cuda.mem_get_info(device)[0]
    gpu = torch.cuda.get_device_name(device)
    progress(f"{gpu}, torch {torch.__version__}; base profile {profile.name}")
    matmul, attention, attention_bwd, sources, copies, copies_bwd, sdpa = {}, {}, {}, {}, {}, {}, {}
    for name in names:
        dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[name])
        size = DTYPES[name]
        peak = next((v[size] for k, v in PEAKS.items() if gpu.startswith(k)), None)
        mm = measure_matmul(torch, dtype, device, args.iters, args.warmup)
        att = measure_attention(torch, dtype, device, args.iters, args.warmup)
        t0 = time.perf_counter()
        points = measure_sdpa(torch, dtype, size, device, args.iters, args.warmup)
        progress(f"sdpa {name}: {len(points)} shapes in {time.perf_counter() - t0:.0f} s")
        if points:
            sdpa[str(size)] = SdpaTable(tuple(points), "enable_gqa")
            sources[f"sdpa.{size}"] = (f"measured ({name}, scaled_dot_product_attention is_causal, enable_gqa, "
                                       f"{len(points)} shapes, backends {', '.join(sdpa[str(size)].backends())})")
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
    layers, layer_calls = measure_layers(torch, device, args.iters, args.warmup)
    t0 = time.perf_counter()
    host, outside, block, peers, where = reference_host(torch, device, args.iters, args.warmup, progress)
    overlap = measure_overlap(torch, args.iters, args.warmup, progress)
    progress(f"host and overlap: {time.perf_counter() - t0:.0f} s")
    sources["host_s"] = (f"measured: the host's issue time of a small Llama block ({block}, {REFERENCE}) on each "
                         f"apply path, per layer occurrence, over a process group of one"
                         + (f" ({', '.join(peers)} {where})" if peers else ""))
    if outside:
        sources["host_outside_s"] = (f"measured: the same model's issue time outside its blocks (one block's model "
                                     f"less the block: the embedding and the head split by vocabulary, the loss "
                                     f"vocabulary-parallel) on {', '.join(outside)} {where}, per micro-batch / step")
    sources["overlap"] = ("measured: a stream of a block's bf16 products (calibrate.overlap.MATMULS) beside " + (
        "NCCL collectives of 256 MiB between 2 GPUs" if overlap["peer"] == "nccl" else
        "256 MiB device copies (one GPU visible: a stand-in for the collectives)") + ", over the stream alone")
    progress("layers (ns per element forward / backward; us per call forward / backward): "
             + ", ".join(f"{k} {f * 1e9:.4f}/{b * 1e9:.4f}; {layer_calls[k][0] * 1e6:.1f}/{layer_calls[k][1] * 1e6:.1f}"
                         for k, (f, b) in layers.items()))
    sizes = " and ".join(f"{t // 1024} Ki tokens x {h // 1024} Ki hidden" for t, h in LAYER_SIZES)
    sources["layer_s"] = ("measured: the memory-bound pieces of a user's step as executed (calibrate.layers) at "
                          f"{sizes}, {LAYER_QUEUE} calls at a time between long matmuls; the line through both: per element")
    sources["layer_call_s"] = "measured: the same line's cost per call (its intercept, at least 0)"
    sources.update(memory_Bps=f"measured: device copy of 1 GiB, {mem / 1e9:.0f} GB/s read+write",
                   **{f"op_Bps.{k}": f"measured: {OP_SOURCES[k]}, {v / 1e9:.0f} GB/s" for k, v in ops.items()},
                   launch_s=f"measured: one-element kernel queued behind a matmul, {launch * 1e6:.2f} us")
    stamp = _dt.datetime.now().isoformat(timespec="seconds")
    kept = profile.compute.context_core if profile.compute is not None else {}  # tests/gpu/context_attention.py's
    sources.update({f"context_core.{k}": profile.compute.sources.get(f"context_core.{k}", "kept from the base profile")
                    for k in kept})
    profile.compute = ComputeModel(
        source=f"python -m calibrate compute on {gpu}, torch {torch.__version__}, {stamp}; medians of {args.iters} isolated runs, or of 3 batches of them back to back (calibrate.measure)",
        kind="measured", launch_s=launch, memory_Bps=mem, matmul=matmul, attention=attention, sources=sources,
        attention_backward=attention_bwd, attention_copies=copies, attention_copies_backward=copies_bwd,
        op_Bps=ops, sdpa=sdpa, layer_s=layers, layer_call_s=layer_calls, host_s=host,
        host_outside_s=outside, overlap=overlap, context_core=kept)
    profile.device = device_memory(torch, device, free_at_start)
    path = profile.save(out)
    progress(f"memory {mem / 1e9:.0f} GB/s (copy), " + ", ".join(f"{v / 1e9:.0f} GB/s ({k})" for k, v in ops.items())
             + f", launch {launch * 1e6:.2f} us")
    progress(f"{profile.device.name}: {profile.device.total_bytes / 2**30:.2f} GiB total, "
             f"{profile.device.usable_bytes / 2**30:.2f} GiB usable; whole run {time.perf_counter() - started:.0f} s")
    print(f"wrote the compute section of {profile.name} to {path}")
    return 0
