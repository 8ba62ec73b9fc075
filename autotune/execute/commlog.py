"""The collectives of one training step, recorded as they are issued (the plan's
boxings forward and backward, the loss's max all-reduce, the gradient
all-reduces), so that they can be replayed alone: the same calls, sizes and
order, on the same mesh and groups, with no compute beside them.

Why a replay: the time inside the NCCL kernels of a step (the torch profiler's
figure) is not the communication the plan predicts. A kernel starts when it is
launched and ends when its data has arrived, so it includes its wait for the
peer (the other device still computing the layer before) and its slowdown by
the compute kernels it overlaps (they share SMs and memory bandwidth). The
prediction is the time of the collectives themselves. The replay measures that:
each call is issued synchronously on zero-filled buffers of the recorded shape
and dtype, by the same code path (DTensor's redistribute, ``dist.all_reduce``),
timed as one sequence between CUDA events (wall clock on CPUs), the median over
repetitions, the slowest device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("redistribute", "max", "allreduce")


@dataclass(frozen=True)
class Call:
    kind: str  # one of KINDS
    local: tuple[int, ...]  # this device's piece
    dtype: object
    shape: tuple[int, ...] = ()  # the whole tensor (redistribute, max)
    src: tuple[str, ...] = ()  # fine placements (redistribute, max: the split placements)
    dst: tuple[str, ...] = ()
    axes: tuple[int, ...] = ()  # fine axes of the group (allreduce)


@dataclass
class CommLog:
    """Calls recorded while ``on``."""

    on: bool = False
    calls: list[Call] = field(default_factory=list)

    def add(self, call: Call) -> None:
        if self.on:
            self.calls.append(call)
