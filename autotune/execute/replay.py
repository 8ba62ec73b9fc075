"""Replay one training step's collectives alone (``autotune.execute.commlog`` says
why): the recorded calls, in their order, on zero-filled buffers of their
shapes, through the same code (``layout.redistribute``, ``ops.max_over``,
``dist.all_reduce`` on the same groups), synchronously, with no compute.

Two figures per step. The wall figure: the boxings (redistribution, the plan's
``redistribution_s``) then the gradient all-reduces (``grad_sync_s``) timed as
two sequences between CUDA events (wall clock after a barrier on CPUs), one
repetition to warm up, the median of the rest, the slowest device; it includes
the host's time to issue each call (DTensor's dispatch), during which the GPU
idles. The kernel figure (GPUs): the same sequences under the torch profiler,
each NCCL kernel's duration, the minimum over the devices (a kernel on the
device that launched first also waits for the others; on the one that launched
last it does not), summed per step: the collectives' own time, which is what
the plan's alpha-beta costs predict.
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


def _kernel_seconds(fns, d, reps: int) -> float | None:
    """Seconds per repetition inside NCCL kernels, each the minimum over the devices (GPUs only)."""
    if not d.is_gpu or not fns:
        return None if not d.is_gpu else 0.0
    from torch.profiler import ProfilerActivity, profile

    from autotune.execute.trace import is_comm, min_over_devices
    from autotune.execute.train import device_events

    torch.cuda.synchronize(d.device)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for f in fns:
                f()
        torch.cuda.synchronize(d.device)
    mine = [e.end - e.start for e in sorted(device_events(prof), key=lambda e: e.start)
            if is_comm(e.name) and not e.annotation]
    everyone = [None] * d.launch.world
    dist.all_gather_object(everyone, mine)
    return min_over_devices(everyone) / 1e6 / reps


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
    red_k, grad_k = _kernel_seconds(boxing, d, reps), _kernel_seconds(sync, d, reps)
    counts: dict[str, int] = {}
    for c in calls:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    out = {"comm_alone_wall_s": red_s + grad_s, "redistribution_alone_wall_s": red_s, "grad_sync_alone_wall_s": grad_s,
           "comm_calls": counts}
    if red_k is None:  # CPUs: the wall figure is the one there is
        out.update(comm_alone_s=red_s + grad_s, redistribution_alone_s=red_s, grad_sync_alone_s=grad_s,
                   comm_alone_source=f"the step's {len(calls)} collectives replayed alone, synchronously, wall clock, "
                                     f"median of {reps}")
    else:
        out.update(comm_alone_s=red_k + grad_k, redistribution_alone_s=red_k, grad_sync_alone_s=grad_k,
                   comm_alone_source=f"the step's {len(calls)} collectives replayed alone: NCCL kernel time, the "
                                     f"minimum over the devices, mean of {reps} repetitions")
    return out
