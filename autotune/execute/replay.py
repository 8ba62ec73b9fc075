"""Replay one training step's collectives alone (``autotune.execute.commlog`` says
why): the recorded calls, in their order, on zero-filled buffers of their
shapes, through the same code (``layout.redistribute``, ``ops.max_over``,
``dist.all_reduce`` on the same groups), synchronously, with no compute.

Two figures per step. The wall figure: the boxings (redistribution, the plan's
``redistribution_s``) then the gradient all-reduces (``grad_sync_s``) timed as
two arms of the measurement engine (``calibrate.measure``: interleaved in rounds, a
barrier before each, the host clock around a synchronised call, one call to warm up),
the slowest device each round, the median; it includes
the host's time to issue each call (DTensor's dispatch), during which the GPU
idles. The kernel figure (GPUs): the same sequences under the torch profiler,
each NCCL kernel's duration, the minimum over the devices (a kernel on the
device that launched first also waits for the others; on the one that launched
last it does not), summed per step: the collectives' own time, which is what
the plan's alpha-beta costs predict.
"""
from __future__ import annotations

from autotune.execute.commlog import Call
from autotune.execute.layout import redistribute, torch
from autotune.execute.ops import max_over
from calibrate.measure.engine import Arm, Options, TimingMode, TorchGroup, compare

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


class _Sequence(Arm):
    """One of the step's two sequences as an arm of the measurement engine: a call runs it once,
    synchronously issued; its wall time includes the host's time to issue each collective."""

    def __init__(self, fns, d):
        self.fns, self.d = fns, d

    def call(self) -> None:
        for f in self.fns:
            f()

    def synchronize(self) -> None:
        if self.d.is_gpu:
            torch.cuda.synchronize(self.d.device)


def _wall(boxing, sync, d, reps: int) -> tuple[float, float]:
    """Seconds of each sequence: the two interleaved in ``reps`` rounds, one call a round after a
    barrier, one call to warm up, the maximum over the ranks, the median (``calibrate.measure``)."""
    arms = [(name, lambda fns=fns: _Sequence(fns, d)) for name, fns in (("boxing", boxing), ("sync", sync)) if fns]
    if not arms:
        return 0.0, 0.0
    res = compare(TorchGroup(d.device), arms, Options(TimingMode.HOST, rounds=reps, calls=1, min_batch_s=0.0,
                                                      warmup=1, check=False))
    bad = [f"{n}: {a.reason}" for n, a in res.arms.items() if not a.ok]
    if bad:
        raise RuntimeError(f"replaying the step's collectives failed: {'; '.join(bad)}")
    return tuple(res[n].median_s if n in res.arms else 0.0 for n in ("boxing", "sync"))


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
    red_s, grad_s = _wall(boxing, sync, d, reps)
    red_k, grad_k = _kernel_seconds(boxing, d, reps), _kernel_seconds(sync, d, reps)
    counts: dict[str, int] = {}
    for c in calls:
        counts[c.kind] = counts.get(c.kind, 0) + 1
    out = {"comm_alone_wall_s": red_s + grad_s, "redistribution_alone_wall_s": red_s, "grad_sync_alone_wall_s": grad_s,
           "comm_calls": counts}
    if red_k is None:  # CPUs: the wall figure is the one there is
        out.update(comm_alone_s=red_s + grad_s, redistribution_alone_s=red_s, grad_sync_alone_s=grad_s,
                   comm_alone_source=f"the step's {len(calls)} collectives replayed alone, synchronously, wall clock, "
                                     f"the slowest rank, median of {reps} rounds")
    else:
        out.update(comm_alone_s=red_k + grad_k, redistribution_alone_s=red_k, grad_sync_alone_s=grad_k,
                   comm_alone_source=f"the step's {len(calls)} collectives replayed alone: NCCL kernel time, the "
                                     f"minimum over the devices, mean of {reps} repetitions")
    return out
