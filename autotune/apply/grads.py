"""Gradient accumulation as the plans price it: each gradient reduced over the data ranks once a step, with a
step's last micro-batch. ``accumulate(model, micro_batches)`` runs the backward of all but the last under
``no_sync(model)``: DDP's ``no_sync()``, or the ``GradSync`` flag that the DTensor path's hooks read
(``sync_grad``: a replicated weight's partial sum all-reduced once it is accumulated, unless the flag is off). A
pipeline's DTensor stage reduces once after its schedule (``reduce_grads``). fully_shard reduce-scatters in every
backward, as its plans are priced."""
from __future__ import annotations

import contextlib


class GradSync:
    """Whether the DTensor path's hooks reduce the gradients in the running backward: not under ``off()``
    (``no_sync``), where each rank accumulates its own."""

    def __init__(self):
        self.on = True

    @staticmethod
    def of(model) -> "GradSync":
        """A new flag, marked on ``model`` for ``no_sync``."""
        model._autotune_grad_sync = sync = GradSync()
        return sync

    @contextlib.contextmanager
    def off(self):
        self.on = False
        try:
            yield
        finally:
            self.on = True


def no_sync(model):
    """The context a backward accumulates this rank's gradients in without reducing them over the data ranks
    (DDP's ``no_sync()``; the DTensor path's ``GradSync``); on a path that reduces in every backward (fully_shard's
    reduce-scatter, as the plans price it) or on one device, no context."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    sync = getattr(model, "_autotune_grad_sync", None)
    return sync.off() if sync is not None else contextlib.nullcontext()


def accumulate(model, pieces):
    """Each of ``pieces`` (a step's micro-batches: ``autotune.micro_batches``) in turn, the backward of all but the
    last run under ``no_sync(model)``: the gradients reduced once a step, with the last micro-batch's backward, as
    every plan prices them (run the forward and the backward inside the loop's body)."""
    pieces = list(pieces)
    for i, piece in enumerate(pieces):
        with no_sync(model) if i < len(pieces) - 1 else contextlib.nullcontext():
            yield piece


def reduce_grad(param) -> None:
    """``param.grad`` reduced to the parameter's own placements where they differ (a replicated weight's partial
    sum over the data ranks all-reduced)."""
    from torch.distributed.tensor import DTensor
    g = param.grad
    if isinstance(g, DTensor) and isinstance(param, DTensor) and g.placements != param.placements:
        param.grad = g.redistribute(param.device_mesh, param.placements)


def reduce_grads(module) -> None:
    """Every parameter's accumulated gradient reduced (``reduce_grad``)."""
    for p in module.parameters():
        reduce_grad(p)


def sync_grad(param, *, sync: GradSync) -> None:
    """The DTensor path's hook after a backward's gradient is accumulated into ``param.grad``: reduced unless
    ``sync`` is off."""
    if sync.on:
        reduce_grad(param)
