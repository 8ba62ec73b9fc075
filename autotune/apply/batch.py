"""Cutting the batch: each data-parallel rank holds its own piece of every batch (``DataSplit``; the user takes
it with ``data_piece(model, batch)`` or a sampler of ``data_world(model)``), the plan's micro-batches
(``micro_batches``; their gradients accumulated: ``autotune.apply.grads``), and the check, before any step, that
the plan's token splits give whole sequences."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from calibrate.errors import UserError
from calibrate.modulehost import param_groups  # noqa: F401 (autotune.param_groups)
from calibrate.optional import require_torch

from autotune.plan.file import load_plan
from autotune.plan.layouts import Tokens
from autotune.plan.typed import TypedPlan

torch = require_torch()


@dataclass(frozen=True)
class DataSplit:
    """This rank's piece of every batch: piece ``rank`` of ``world`` along dimension 0."""

    rank: int
    world: int

    def piece(self, t, where: str):
        if isinstance(t, dict):
            return {k: self.piece(v, where) for k, v in t.items()}
        if isinstance(t, (tuple, list)):
            return type(t)(self.piece(v, where) for v in t)
        if t.shape[0] % self.world:
            raise UserError(f"{where}: a batch of {t.shape[0]} does not split over the plan's {self.world} "
                            f"data-parallel devices: use a batch that {self.world} divides")
        return t.chunk(self.world)[self.rank]

    def mark(self, model):
        """``model`` told which piece its calls take (``data_piece``); returns ``model``."""
        model._autotune_data_split = self
        return model

    def cut_calls(self, model) -> None:
        """``model``'s calls cut to this piece (``_local_batch``): a pipeline's first stage, fed the micro-batch."""
        self.mark(model)
        model.register_forward_pre_hook(functools.partial(_local_batch, split=self), with_kwargs=True, prepend=True)


def _local_batch(module, args, kwargs, *, split: DataSplit):
    """Every tensor of the call whose first dimension is the batch cut to this rank's piece."""
    first = next((t for t in (*args, *kwargs.values()) if hasattr(t, "dim") and t.dim() >= 1), None)
    if first is None:
        return None
    batch = first.shape[0]

    def cut(t):
        return split.piece(t, "the model's input") if hasattr(t, "dim") and t.dim() >= 1 and t.shape[0] == batch \
            else t
    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def data_piece(model, batch):
    """This rank's piece of ``batch`` (a tensor, or a dict or tuple of them, the same on every rank), the piece a model
    placed by ``autotune.apply`` takes; ``batch`` itself on one device."""
    split = getattr(model, "_autotune_data_split", None)
    return batch if split is None else split.piece(batch, "data_piece")


def data_world(model) -> tuple[int, int]:
    """(this rank's piece, the number of pieces): ``DistributedSampler(..., rank=, num_replicas=)``'s arguments."""
    split = getattr(model, "_autotune_data_split", None)
    return (0, 1) if split is None else (split.rank, split.world)


def check_batch(plan: TypedPlan, where: str = "the plan", skip: tuple[int, ...] = ()) -> None:
    """Every layer's token split (S0) falls on whole sequences or on a sequence that divides (``Tokens``), and the
    attention's on whole sequences, the axes ``skip`` left out (context parallelism's: its chunks): one line
    naming the fix, before any weight moves."""
    mb, seq = plan.model.get("micro_batch"), plan.model.get("sequence")
    if mb is None:
        return
    tokens = Tokens(mb, plan.mesh.sizes)
    for lay in plan.layers:
        for fine in (lay.input, lay.output):
            if fine is None:
                continue
            dims = tokens.dims(fine)
            parts = math.prod(n for a, (p, n, d) in enumerate(zip(fine, plan.mesh.sizes, dims))
                              if p == "S0" and d == 1 and a not in skip)
            if parts > 1 and (lay.kind == "attention" or (seq is not None and seq % parts)):
                why = ("which its attention cannot take" if lay.kind == "attention" else
                       f"and the sequence of {seq} does not split over {parts}")
                raise UserError(f"{where}: layer {lay.name} splits the tokens of a micro-batch of {mb} sequences over "
                                f"more devices than it has sequences, {why}: search with a larger micro-batch "
                                f"(--micro-batch) or fewer devices")


def stream_by_sequence(plan: TypedPlan, skip: tuple[int, ...] = ()) -> int:
    """The devices the plan's residual stream (the embedding's output) splits each sequence over (1: none), the
    axes ``skip`` left out."""
    mb, lay = plan.model.get("micro_batch"), plan.layer("residual") or plan.layer("embedding")
    fine = (lay.input if lay is plan.layer("residual") else lay.output) if lay is not None else None
    if mb is None or fine is None:
        return 1
    dims = Tokens(mb, plan.mesh.sizes).dims(fine)
    return math.prod(n for a, (p, n, d) in enumerate(zip(fine, plan.mesh.sizes, dims))
                     if p == "S0" and d == 1 and a not in skip)


class _ScaleGrad(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def scale_grad(x, *, factor: float):
    return _ScaleGrad.apply(x, factor)


def micro_batches(plan, batch) -> list:
    """``batch`` (a tensor, or a dict of tensors) split along dimension 0 into the plan's micro-batches."""
    plan = load_plan(plan)
    n = plan.micro_batches
    # a piece of data_piece's: the whole batch splits over the data-parallel ranks, then into micro-batches
    hint = (f" (this rank's piece of data_piece's: a whole batch that {n} x the data-parallel ranks divide, as the "
            f"plan's {plan.model.get('batch')})"
            if plan.world > 1 and plan.model.get("batch") else "")
    if isinstance(batch, dict):
        parts = {k: micro_batches_of(v, n, hint) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    return micro_batches_of(batch, n, hint)


def micro_batches_of(t, n: int, hint: str = "") -> list:
    if t.shape[0] % n:
        raise UserError(f"a batch of {t.shape[0]} does not split into the plan's {n} micro-batches: use a batch "
                        f"that {n} divides{hint}")
    return list(t.chunk(n, dim=0))
