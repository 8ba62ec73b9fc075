"""The tensor-parallel path: torch's ``parallelize_module`` on the plan's tensor-parallel axis, as torchtitan's
``parallelize_llama`` composes it: q/k/v (gate/up) ``ColwiseParallel``, the projections ``RowwiseParallel``, the
embedding split by vocabulary ``RowwiseParallel`` (ids whole on the axis), the logits split by vocabulary
``ColwiseParallel`` handing out a DTensor of vocabulary columns for ``loss_parallel`` (nothing gathered); the
compute runs on local tensors. A plan without FSDP whose other axes are data axes (Megatron's d x t without
sequence parallelism) runs it with fully_shard on a replicate mesh over the data axes (torchtitan's DDP + TP);
``autotune.apply.fsdp`` runs it for TP + FSDP."""
from __future__ import annotations

from autotune.apply.layers import Site
from autotune.plan.layouts import TP_WEIGHTS, FullyShard, tp_axis_ok
from autotune.plan.typed import TypedPlan
from autotune.sbp.sbp import B


def tp_layout(plan: TypedPlan) -> FullyShard | None:
    """The layout of a plan without FSDP that is data parallel on every axis but the last, and tensor parallel
    there as ``tp_axis_ok`` (Megatron's without sequence parallelism); None otherwise."""
    n = len(plan.mesh.sizes)
    if plan.world == 1 or plan.sharding_mode == "fsdp" or not tp_axis_ok(plan, n - 1) or plan.mesh.sizes[-1] == 1:
        return None
    for a in range(n - 1):
        if any(w.placements[a] != B for lay in plan.layers for w in lay.weights) or any(
                f is not None and f[a] != "S0" for lay in plan.layers for f in (lay.input, lay.output)):
            return None
    return FullyShard(tuple(range(n - 1)), (), n - 1)


def tp_styles(chain: list[Site], tp: int) -> dict | None:
    """module name -> ``parallelize_module`` style for the plan's tensor-parallel axis; None where the modules
    cannot take them (not ``nn.Linear`` / ``nn.Embedding``, or a weight tied between two mapped modules)."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    styles, owners = {}, {}
    for site in chain:
        for i, (name, module) in enumerate(site.modules):
            for p in module.parameters(recurse=False):
                if id(p) in owners:
                    return None
                owners[id(p)] = name
            style = None
            if site.layer.name in TP_WEIGHTS and not (site.layer.kind == "embedding" and i > 0):
                style = TP_WEIGHTS[site.layer.name][site.layer.weight("weight").placements[tp]]
            if style is None:
                continue
            if type(module) not in (nn.Linear, nn.Embedding) or (type(module) is nn.Embedding and style != "rowwise"):
                return None
            if site.layer.name == "logits":  # vocabulary columns for loss_parallel
                styles[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            elif site.layer.kind == "embedding":  # token ids, whole on every device of the axis
                styles[name] = RowwiseParallel(input_layouts=Replicate())
            else:
                styles[name] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    return styles


def parallelize(model, chain: list[Site], tp: int, mesh) -> None:
    """``parallelize_module`` of ``model`` on ``mesh`` (the tensor-parallel axis) by ``tp_styles``."""
    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(model, mesh, tp_styles(chain, tp))
