"""Where a training step's time goes, layer by layer: the forward of each chain position
(its input boxing and its op) and its backward (the op's backward and the boxing's), and
the optimizer step, each the time between two marks on the device's timeline.

On GPUs a mark is a CUDA event recorded on the current stream when the host issues it (so
the time between two marks is the device's time for the work issued between them, plus
any wait for the host); on CPUs, where every op runs as it is issued, the host's clock.
Backward marks are recorded by tensor hooks as autograd computes the gradient of each
layer's output: the backward of position p runs from the gradient of p's output to the
gradient of p - 1's output (the first position's, to the end of ``backward()``). Nothing
here synchronises: the times are read after the step, once the device is idle.
"""
from __future__ import annotations

import contextlib
import statistics

from calibrate.optional import require_torch

torch = require_torch()
from calibrate.measure.torcharm import mark as device_mark, span


def mark(gpu: bool):
    """A point on the device's timeline (``calibrate.measure.torcharm.mark``: a CUDA event on GPUs,
    the host's clock on CPUs)."""
    return device_mark(torch, gpu)


class LayerClock:
    def __init__(self, names: list[tuple[str, str]], gpu: bool):
        self.names = names  # per chain position: (layer name, layer kind)
        self.gpu = gpu
        self.fwd: list[list] = []  # per micro-batch: per position (start mark, end mark)
        self.grad: list[dict] = []  # per micro-batch: position -> mark when its output's gradient is ready
        self.bwd_end: list = []  # per micro-batch: the mark after backward()
        self.opt: tuple | None = None

    def mark(self):
        return mark(self.gpu)

    def micro_batch(self) -> None:
        self.fwd.append([None] * len(self.names))
        self.grad.append({})

    @contextlib.contextmanager
    def around(self, pos: int):
        start = self.mark()
        yield
        self.fwd[-1][pos] = (start, self.mark())

    def after(self, pos: int, out) -> None:
        """``out``: position ``pos``'s output; its gradient's arrival marks the start of the
        position's backward."""
        if getattr(out, "requires_grad", False):
            grads = self.grad[-1]

            def hook(g):
                grads[pos] = self.mark()
            out.register_hook(hook)

    def backward_done(self) -> None:
        self.bwd_end.append(self.mark())

    @contextlib.contextmanager
    def optimizer(self):
        start = self.mark()
        yield
        self.opt = (start, self.mark())

    def span(self, a, b) -> float:
        return span(a, b, self.gpu)

    def result(self) -> dict:
        """After the device is idle: per position the forward and backward seconds (the mean over
        the micro-batches), and the optimizer step's seconds."""
        n = len(self.names)
        fwd = [[self.span(*mb[p]) for mb in self.fwd if mb[p] is not None] for p in range(n)]
        bwd = [[] for _ in range(n)]
        for grads, end in zip(self.grad, self.bwd_end):
            for p in range(n):
                stop = end if p == 0 else grads.get(p - 1)
                if p in grads and stop is not None:
                    bwd[p].append(self.span(grads[p], stop))
        layers = [{"position": p, "name": name, "kind": kind,
                   "forward_s": statistics.fmean(fwd[p]) if fwd[p] else None,
                   "backward_s": statistics.fmean(bwd[p]) if bwd[p] else None}
                  for p, (name, kind) in enumerate(self.names)]
        return {"layers": layers, "optimizer_s": self.span(*self.opt) if self.opt else None}
