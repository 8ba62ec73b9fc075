"""Replay one training step's collectives alone (``autotune.execute.commlog`` says
why): the recorded calls, in their order, on zero-filled buffers of their
shapes, through the same code (``layout.redistribute``, ``ops.max_over``,
``dist.all_reduce`` on the same groups), synchronously, with no compute.

Timed as two sequences per repetition, the boxings (redistribution, the
plan's ``redistribution_s``) then the gradient all-reduces (``grad_sync_s``),
between CUDA events on GPUs (wall clock after a barrier on CPUs); one
repetition to warm up, the median of the rest, the slowest device.
"""
from __future__ import annotations

import statistics
import time

from autotune.execute.commlog import Call
from autotune.execute.layout import redistribute, torch
from autotune.execute.ops import max_over

dist = torch.distributed
REPS = 5


def _runner(call: Call, d, ctx):
    buf = torch.zeros(call.local, dtype=call.dtype, device=d.device)
    if call.kind == "redistribute":
        return lambda: redistribute(buf, ctx.mesh, call.shape, call.src, call.dst, ctx.coords)
    if call.kind == "max":
        return lambda: max_over(ctx.mesh, ctx.axis_sizes, buf, call.src)
    group = d.group(call.axes)
    return lambda: dist.all_reduce(buf, group=group)


def _timed(fns, d) -> float:
    if not fns:
        return 0.0
    if d.is_gpu:
        torch.cuda.synchronize(d.device)
    dist.barrier()
    if d.is_gpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for f in fns:
            f()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for f in fns:
        f()
    return time.perf_counter() - t0


def _slowest(x: float, d) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def replay(calls: list[Call], d, ctx, reps: int = REPS) -> dict:
    """{"comm_alone_s", "redistribution_alone_s", "grad_sync_alone_s", "comm_calls"} of the recorded step."""
    boxing = [_runner(c, d, ctx) for c in calls if c.kind != "allreduce"]
    sync = [_runner(c, d, ctx) for c in calls if c.kind == "allreduce"]
    red, grad = [], []
    for r in range(reps + 1):
        a, b = _timed(boxing, d), _timed(sync, d)
        if r:
            red.append(a)
            grad.append(b)
    red_s, grad_s = _slowest(statistics.median(red), d), _slowest(statistics.median(grad), d)
    counts: dict[str, int] = {}
    for c in calls:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    return {"comm_alone_s": red_s + grad_s, "redistribution_alone_s": red_s, "grad_sync_alone_s": grad_s,
            "comm_calls": counts,
            "comm_alone_source": f"the step's {len(calls)} collectives replayed alone, synchronously, median of {reps}"}
