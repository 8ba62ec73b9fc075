"""An arm of the engine that times one process's torch work on its device, call by call.

``TorchArm``: a call is ``fn(i)`` (``i`` counts the calls, so the caller can rotate
inputs), followed by ``between()`` when given: other work issued after each call and
not timed (a training step interleaves its matmuls with memory-bound kernels). A batch
of calls is timed call by call between two marks: CUDA events recorded on the current
stream on a GPU (the device's time for the call), the host clock on a CPU (where each
op is done when it returns); the batch's seconds are the sum of its calls' spans. In
the engine's ``host`` mode the calls of a batch are issued back to back, after one
untimed call: a batch starts on an idle device, whose first timed call would otherwise
include the host's time to issue it (the device waits between the first mark and the
kernel: one H100, 2026-11-27, a causal SDPA forward of 16 x 16 heads x 1024 x 64 timed in
batches of two read 145 us a call, 110 us with the untimed call first, 103 us in a step); in
``isolated`` mode each call runs alone after a synchronization. ``verify(seed, fn)``,
when given, is the arm's check (``Arm.check``): fresh inputs from ``seed``, one call
through ``fn`` (the arm's own), its wrong elements; without it the comparison runs
with its check off. torch is passed in: this module imports nothing heavy.
"""
from __future__ import annotations

import time
from typing import Callable

from calibrate.measure.engine import Arm, Options, Solo, TimingMode, compare


def mark(torch, cuda: bool):
    """A point on the device's timeline: a CUDA event recorded on the current stream, or (``cuda``
    False: every op is done when it returns) the host's clock."""
    if not cuda:
        return time.perf_counter()
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def span(a, b, cuda: bool) -> float:
    """Seconds from mark ``a`` to mark ``b`` (on a GPU, once both events have completed)."""
    return a.elapsed_time(b) / 1e3 if cuda else b - a


class TorchArm(Arm):
    def __init__(self, torch, device, fn: Callable[[int], object], between: Callable[[], object] | None = None,
                 verify: Callable[[int, Callable], int] | None = None):
        self.torch, self.fn, self.between, self.verify = torch, fn, between, verify
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.i = 0

    def _one(self) -> tuple:
        a = mark(self.torch, self.cuda)
        self.fn(self.i)
        b = mark(self.torch, self.cuda)
        self.i += 1
        if self.between is not None:
            self.between()
        return a, b

    def call(self) -> None:
        self._one()

    def synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def check(self, seed: int) -> int:
        if self.verify is None:
            return super().check(seed)
        return int(self.verify(seed, self.fn))

    def host(self, calls: int) -> Callable[[], float]:
        def run() -> float:
            self._one()  # untimed: the device is busy while the first timed call is issued
            marks = [self._one() for _ in range(calls)]
            self.synchronize()
            return sum(span(a, b, self.cuda) for a, b in marks)
        return run


def timing(iters: int, warmup: int, back_to_back: bool, rounds: int = 3, check: bool = False):
    """The engine's options for ``iters`` timed calls: ``back_to_back``, ``rounds`` interleaved batches
    of back-to-back calls (``iters`` in all, rounded up), each sample a batch's mean call; else
    ``iters`` isolated calls, each a sample."""
    if back_to_back:
        return Options(TimingMode.HOST, rounds=rounds, calls=max(1, -(-iters // rounds)), min_batch_s=0.0,
                       warmup=warmup, check=check)
    return Options(TimingMode.ISOLATED, rounds=iters, calls=1, min_batch_s=0.0, warmup=warmup, check=check)


def medians(torch, arms, options) -> dict[str, float]:
    """{arm: median seconds per call} of one process's comparison (``engine.compare``) of arms that must
    all run: an arm that did not is raised again, as torch's out-of-memory error where it was one (so a
    caller can skip a shape that does not fit)."""
    res = compare(Solo(), arms, options)
    for name, a in res.arms.items():
        if not a.ok:
            if "OutOfMemoryError" in a.reason:
                raise torch.cuda.OutOfMemoryError(f"{name}: {a.reason}")
            raise RuntimeError(f"timing {name} failed: {a.reason}")
    return {name: a.median_s for name, a in res.arms.items()}
