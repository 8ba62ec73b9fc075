"""The tensor-parallel path: torch's ``parallelize_module`` on the plan's tensor-parallel axis, as torchtitan's
``parallelize_llama`` composes it: q/k/v (gate/up) ``ColwiseParallel``, the projections ``RowwiseParallel``, the
embedding split by vocabulary ``RowwiseParallel`` (ids whole on the axis), the logits split by vocabulary
``ColwiseParallel`` handing out a DTensor of vocabulary columns for ``loss_parallel`` (nothing gathered); the
compute runs on local tensors. With sequence parallelism (the layout's ``sequence_parallel``) the residual stream
between the regions is a DTensor split by the sequence (``Shard(1)``): the embedding's and the projections'
outputs reduce-scattered onto it, every norm ``SequenceParallel`` (its weight's gradient summed over the axis)
and its output all-gathered once for the column-parallel layers or the head that read it. A plan without FSDP
whose other axes are data axes (Megatron's d x t) runs it with fully_shard on a replicate mesh over the data axes
(torchtitan's DDP + TP); ``autotune.apply.fsdp`` runs it for TP + FSDP."""
from __future__ import annotations

from autotune.apply.layers import Site
from autotune.plan.layouts import NORMS, TP_WEIGHTS
from autotune.sbp.sbp import B


def tp_styles(chain: list[Site], tp: int, stream: str = B, sequence: bool = False) -> dict | None:
    """module name -> the ``parallelize_module`` styles, applied in order, for the plan's tensor-parallel axis;
    None where the modules cannot take them (not ``nn.Linear`` / ``nn.Embedding``, or a weight two modules share
    split by one and not the other: ``ties``). ``stream`` "S1": the residual stream split by features between the
    layers (each rank adds its columns), so the row-parallel outputs are reduce-scattered to it, the embedding's too
    (learned positions column-split), and each norm's input all-gathered (``PrepareModuleInput``). ``sequence``: the
    stream split by the sequence (Megatron's sequence parallelism, the module doc)."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)
    split = Shard(-1) if stream == "S1" else Shard(1) if sequence else Replicate()
    styles = {}
    for k, site in enumerate(chain):
        for i, (name, module) in enumerate(site.modules):
            norm = site.layer.kind in NORMS
            if norm and sequence:  # on the sequence shards, then gathered once for the layers that read it
                styles[name] = (SequenceParallel(), PrepareModuleOutput(
                    output_layouts=split, desired_output_layouts=Replicate(),
                    use_local_output=not _colwise_next(chain, k, tp)))
                continue
            if norm and stream == "S1":
                styles[name] = (PrepareModuleInput(input_layouts=(split,), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True),)
                continue
            if norm and _colwise_next(chain, k, tp):
                # the norm's output a replicated DTensor once for the column-parallel layers that read it (q, k, v;
                # gate, up): their input gradients summed as one partial sum, one all-reduce a region backward
                # (as torchtitan's PrepareModuleInput on the attention and the MLP), not one per layer
                styles[name] = (PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                                    use_local_output=False),)
                continue
            if site.layer.kind == "embedding" and i > 0 and stream == "S1":  # learned positions, by columns
                styles[name] = (ColwiseParallel(input_layouts=Replicate()),)
                continue
            style = None if site.layer.kind == "embedding" and i > 0 else _style(site, tp)
            if style is None:
                if sequence and site.layer.kind == "embedding":  # replicated: its output cut to the stream's
                    # tokens (learned positions [sequence, hidden] by their dimension 0), a DTensor the stream adds
                    styles[name] = (PrepareModuleOutput(output_layouts=Replicate(),
                                                        desired_output_layouts=Shard(1 if i == 0 else 0),
                                                        use_local_output=False),)
                continue
            if type(module) not in (nn.Linear, nn.Embedding) or (type(module) is nn.Embedding and style != "rowwise"):
                return None
            if site.layer.name == "logits":  # vocabulary columns for loss_parallel
                styles[name] = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),)
            elif site.layer.kind == "embedding":  # token ids, whole on every device of the axis
                styles[name] = (RowwiseParallel(input_layouts=Replicate(), output_layouts=split,
                                                use_local_output=not sequence),)
            else:
                styles[name] = (ColwiseParallel() if style == "colwise" else
                                RowwiseParallel(output_layouts=split, use_local_output=not sequence),)
    return styles if ties(chain, styles) is not None else None


def ties(chain: list[Site], styles: dict) -> list[tuple[str, str, str, str]] | None:
    """(keeper, its attribute, user, its attribute) of each weight two modules of ``chain`` share (a tied embedding
    and head), which ``parallelize`` ties again after the styles replace each module's weight: where every user
    splits it alike (the embedding row-wise and the head column-wise: both keep vocabulary rows, ``Shard(0)``) or
    none splits it; None where one splits it and another does not (the DTensor path then places each use apart)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    users: dict = {}
    for site in chain:
        for name, module in site.modules:
            for attr, p in module.named_parameters(recurse=False):
                users.setdefault(id(p), []).append((name, attr))
    out = []
    for shared in (u for u in users.values() if len(u) > 1):
        split = {any(isinstance(st, (ColwiseParallel, RowwiseParallel)) for st in styles.get(name, ()))
                 for name, _ in shared}
        if split == {True, False}:
            return None
        out += [(*shared[0], *other) for other in shared[1:]] if split == {True} else []
    return out


def _style(site: Site, tp: int) -> str | None:
    """The style (``TP_WEIGHTS``) of a site's layer on axis ``tp``: "colwise", "rowwise", or None."""
    w = site.layer.weight("weight") if site.layer.name in TP_WEIGHTS else None
    return None if w is None else TP_WEIGHTS[site.layer.name].get(w.placements[tp])


def _colwise_next(chain: list[Site], k: int, tp: int) -> bool:
    """Whether the chain's next layer after site ``k`` with modules is placed column-wise on axis ``tp``."""
    nxt = next((s for s in chain[k + 1:] if s.modules), None)
    return nxt is not None and _style(nxt, tp) == "colwise"


def parallelize(model, chain: list[Site], layout, mesh) -> None:
    """``parallelize_module`` of ``model``'s modules on ``mesh`` (the tensor-parallel axis) by ``tp_styles``."""
    from torch.distributed.tensor.parallel import parallelize_module
    found = tp_styles(chain, layout.tp, getattr(layout, "stream", B), layout.sequence_parallel)
    shared = ties(chain, found)  # before the styles replace the shared weight in each of its users
    for name, styles in found.items():
        for style in styles:
            parallelize_module(model.get_submodule(name), mesh, style)
    for keeper, attr, user, its in shared:  # one parameter again: both uses' gradients into it
        setattr(model.get_submodule(user), its, getattr(model.get_submodule(keeper), attr))
