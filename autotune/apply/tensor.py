"""The tensor-parallel path: torch's ``parallelize_module`` on the plan's tensor-parallel axis, as torchtitan's
``parallelize_llama`` composes it: q/k/v (gate/up) ``ColwiseParallel``, the projections ``RowwiseParallel``, the
embedding split by vocabulary ``RowwiseParallel`` (ids whole on the axis), the logits split by vocabulary
``ColwiseParallel`` handing out a DTensor of vocabulary columns for ``loss_parallel`` (nothing gathered); the
compute runs on local tensors. A plan without FSDP whose other axes are data axes (Megatron's d x t without
sequence parallelism) runs it with fully_shard on a replicate mesh over the data axes (torchtitan's DDP + TP);
``autotune.apply.fsdp`` runs it for TP + FSDP."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autotune.apply.layers import Site
from autotune.plan.layouts import TP_WEIGHTS, tp_axis_ok
from autotune.plan.typed import TypedPlan
from autotune.sbp.sbp import B


@dataclass(frozen=True)
class TensorParallel:
    """Data axes, then tensor-parallel axes (one flattened mesh dimension "tp", ranks row-major over them as
    DTensor nests one dimension split over several axes); ``tp`` the first of them (their placements alike)."""

    data: tuple[int, ...]
    tp_axes: tuple[int, ...]
    stream: str = B  # the residual stream on the tensor-parallel axes: whole (torchtitan's), or split by features

    @property
    def tp(self) -> int:
        return self.tp_axes[0]

    def dims(self, plan: TypedPlan) -> dict[str, int]:
        """fully_shard's mesh: a replicate dimension (the data axes) and "tp"; "shard" of one device."""
        sizes = plan.mesh.sizes
        return {"replicate": math.prod(sizes[a] for a in self.data), "shard": 1,
                "tp": math.prod(sizes[a] for a in self.tp_axes)}


def tp_layout(plan: TypedPlan) -> TensorParallel | None:
    """The layout of a plan without FSDP that is data parallel on its leading axes and tensor parallel on the
    others as ``tp_axis_ok`` (Megatron's without sequence parallelism), the same on each; None otherwise."""
    n = len(plan.mesh.sizes)
    if plan.world == 1 or plan.sharding_mode == "fsdp":
        return None

    def data_axis(a: int) -> bool:
        return all(w.placements[a] == B for lay in plan.layers for w in lay.weights) and all(
            f is None or f[a] == "S0" for lay in plan.layers for f in (lay.input, lay.output))

    data = 0
    while data < n and data_axis(data):
        data += 1
    tp = tuple(a for a in range(data, n) if plan.mesh.sizes[a] > 1)
    residual = plan.layer("residual")
    stream = residual.input[tp[0]] if tp and residual is not None and residual.input else B
    if stream not in (B, "S1") or (residual is not None and residual.output != residual.input):
        return None
    whole = replace(plan, layers=tuple(  # the stream split by features read as whole: the styles' boundaries
        replace(lay, input=tuple(B if a in tp else p for a, p in enumerate(lay.input)),
                output=tuple(B if a in tp else p for a, p in enumerate(lay.output)))
        if lay is residual else lay for lay in plan.layers))
    if not tp or not all(tp_axis_ok(whole, a) for a in tp) or any(
            lay.weight(w.name).placements[a] != lay.weight(w.name).placements[tp[0]]
            for lay in plan.layers for w in lay.weights for a in tp) or any(
            f is not None and f[a] != f[tp[0]] for lay in plan.layers for f in (lay.input, lay.output) for a in tp):
        return None
    return TensorParallel(tuple(range(data)), tp, stream)


def tp_styles(chain: list[Site], tp: int, stream: str = B) -> dict | None:
    """module name -> ``parallelize_module`` style for the plan's tensor-parallel axis; None where the modules
    cannot take them (not ``nn.Linear`` / ``nn.Embedding``, or a weight tied between two mapped modules).
    ``stream`` "S1": the residual stream split by features between the layers (each rank adds its columns), so
    the row-parallel outputs are reduce-scattered to it, the embedding's too (learned positions column-split),
    and each norm's input all-gathered (``PrepareModuleInput``)."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    split = Shard(-1) if stream == "S1" else Replicate()
    styles, owners = {}, {}
    for site in chain:
        for i, (name, module) in enumerate(site.modules):
            for p in module.parameters(recurse=False):
                if id(p) in owners:
                    return None
                owners[id(p)] = name
            style = None
            if site.layer.kind in ("layernorm", "rmsnorm") and stream == "S1":
                styles[name] = PrepareModuleInput(input_layouts=(split,), desired_input_layouts=(Replicate(),),
                                                  use_local_output=True)
                continue
            if site.layer.kind == "embedding" and i > 0 and stream == "S1":  # learned positions, by columns
                styles[name] = ColwiseParallel(input_layouts=Replicate())
                continue
            if site.layer.name in TP_WEIGHTS and not (site.layer.kind == "embedding" and i > 0):
                style = TP_WEIGHTS[site.layer.name][site.layer.weight("weight").placements[tp]]
            if style is None:
                continue
            if type(module) not in (nn.Linear, nn.Embedding) or (type(module) is nn.Embedding and style != "rowwise"):
                return None
            if site.layer.name == "logits":  # vocabulary columns for loss_parallel
                styles[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            elif site.layer.kind == "embedding":  # token ids, whole on every device of the axis
                styles[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=split)
            else:
                styles[name] = ColwiseParallel() if style == "colwise" else RowwiseParallel(output_layouts=split)
    return styles


def parallelize(model, chain: list[Site], layout, mesh) -> None:
    """``parallelize_module`` of ``model`` on ``mesh`` (the tensor-parallel axis) by ``tp_styles``."""
    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(model, mesh, tp_styles(chain, layout.tp, getattr(layout, "stream", B)))
