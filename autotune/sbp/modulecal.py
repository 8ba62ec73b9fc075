"""The step model's prices corrected by the user's own module, timed on one GPU (the profile's ``module``
section, ``calibrate.module``; measured by ``python -m calibrate module``).

The measured block is one whole transformer block; the step model prices layer by layer. Per measured
point (tensor width t, local micro-batch m, sequence s) the analytical model prices the same local block
on one device (the model's graph of one block with heads, K/V heads, MLP width and vocabulary divided by
t, micro-batch m: ``analytical``), and the ratio measured / analytical, per part (forward, backward,
recomputation, optimizer step; the block, and the layers outside the blocks), scales every layer of that
part whose strategy runs that local shape. So where the plan's layers run a measured shape, the block's
predicted seconds are the measured seconds exactly (a closed form: a block measured at X s a micro-batch
predicts X x blocks x micro-batches), and the analytical model's split of them over the block's layers is
kept (the search still compares strategies layer by layer). A layer's local shape: its output's local
rows over the sequence give the micro-batch, the rest of the output's split the tensor width; a layer
whose shape no point matches (another width or sequence, a sequence split) keeps its analytical price,
and the plan's ``compute_source`` says per layer which ("module" or "analytical"). Between measured
micro-batches of a width and sequence, the nearest on a log scale gives the ratio (a ratio moves
little with the micro-batch: the kernels are the same). Gradient accumulation, DTensor's local copies
and FSDP's communication stay analytical.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from calibrate.compute import ComputeModel

from autotune.sbp.layers import Strategy, local_elems, make_op, with_recipe
from autotune.sbp.memory import NONE, OUTSIDE, layer_roles
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import layer_seconds, local_elems_shape, optimizer_seconds

PARTS = ("forward", "backward", "recompute", "optimizer")
ONE = (1.0, 1.0, 1.0, 1.0)


@dataclass(frozen=True)
class ModuleCal:
    """Per measured key (t, m, s): the ratios (forward, backward, recompute, optimizer) of the block and of
    the layers outside the blocks."""

    ratios: tuple  # ((t, m, s, inside: bool), (rf, rb, rr, ro)) pairs
    sequence: int
    micro_batch: int  # the graph's global micro-batch

    def key(self, op, s: Strategy, cluster: Cluster) -> tuple[int, int] | None:
        """(tensor width, local micro-batch) of a layer's strategy, or None where it is no whole one."""
        d = op.dims
        t = s.output if s.output is not None else s.input
        if t is None or "tokens" not in d:
            return None
        rows, _ = local_elems_shape(t, s, cluster)
        tokens = d["tokens"]
        split = math.prod(t.shape) / max(local_elems(t, s.mesh, cluster), 1)
        if rows <= 0 or tokens % rows or rows % self.sequence:
            return None
        width = split / (tokens / rows)
        if abs(width - round(width)) > 1e-9 or round(width) < 1:
            return None
        return round(width), rows // self.sequence

    def ratio(self, inside: bool, key) -> tuple[float, float, float, float] | None:
        if key is None:
            return None
        t, m = key
        found = [(k[1], r) for k, r in self.ratios if k[0] == t and k[2] == self.sequence and k[3] == inside]
        if not found:
            return None
        return min(found, key=lambda x: (abs(math.log(x[0] / m)), -x[0]))[1]


def analytical(graph_of, op_roles_counts, cm: ComputeModel, act_bytes: int) -> tuple[list, list]:
    """(block, outside): the analytical (forward, backward, recompute, optimizer) seconds of one block's layers
    and of the layers outside the blocks of a one-device graph, each layer's one strategy on one device."""
    cl = Cluster(1, 1)
    block, outside = [0.0] * 4, [0.0] * 4
    for layer, role, count in op_roles_counts:
        op = make_op(layer, act_bytes)
        s = with_recipe(op.strategies(cl)[0], layer)
        f, b = layer_seconds(op, s, cl, cm, act_bytes, "none", role)
        _, bf = layer_seconds(op, s, cl, cm, act_bytes, "full", role)
        o = optimizer_seconds(s, cl, cm, act_bytes, NONE, bool(op.dims.get("tied", 0)) and layer.kind == "matmul")
        acc = outside if role == OUTSIDE else block
        for i, v in enumerate((f, b, bf - b, o)):
            acc[i] += count * v
    return block, outside


def calibration(graph, profile) -> ModuleCal | None:
    """The ratios of ``profile``'s module section for ``graph`` (module docstring); None where the profile has no
    such section, it was measured on another model, or the graph is no transformer of blocks."""
    section = getattr(profile, "module", None)
    cm = getattr(profile, "compute", None)
    if section is None or cm is None or not getattr(graph, "blocks", None) or not section.matches(graph.config):
        return None
    from models.builders import BUILDERS
    c = graph.config
    ratios = {}
    for p in section.points:
        if p.sequence != c.get("sequence"):
            continue
        t = p.tensor
        local = dict(c, layers=1, heads=c["heads"] // t, kv_heads=c.get("kv_heads", c["heads"]) // t,
                     ffn=c["ffn"] // t, vocabulary=c["vocabulary"] // t, micro_batch=p.micro_batch,
                     batch=p.micro_batch, head_dim=c.get("head_dim", c["hidden"] // c["heads"]))
        g = BUILDERS[graph.model](local)
        block, outside = analytical(g, zip(g.layers, layer_roles(g), g.counts()), cm, graph.act_bytes)
        measured = {True: (p.block["forward_s"], p.block["backward_s"], p.block["recompute_s"],
                           p.block["optimizer_s"]),
                    False: (p.outside["forward_s"], p.outside["backward_s"], None, p.outside["optimizer_s"])}
        for inside, model in ((True, block), (False, outside)):
            r = [(m / a if m is not None and a > 0 else None) for m, a in zip(measured[inside], model)]
            r[2] = r[2] if r[2] is not None else r[0]  # no recomputation measured: as the forward
            ratios[(t, p.micro_batch, p.sequence, inside)] = tuple(1.0 if x is None else x for x in r)
    if not ratios:
        return None
    return ModuleCal(tuple(sorted(ratios.items())), c["sequence"], graph.micro_batch)


def calibrated_seconds(cal: ModuleCal | None, op, s: Strategy, cluster: Cluster, cm: ComputeModel, act_bytes: int,
                       recompute: str, role: str) -> tuple[float, float]:
    """``layer_seconds`` (forward, backward of a layer occurrence and micro-batch) scaled by the module's ratios
    where the layer's local shape was measured: the backward's recomputed forward by the recomputation's ratio."""
    f, b = layer_seconds(op, s, cluster, cm, act_bytes, recompute, role)
    r = cal.ratio(role != OUTSIDE, cal.key(op, s, cluster)) if cal is not None else None
    if r is None:
        return f, b
    b0 = layer_seconds(op, s, cluster, cm, act_bytes, "none", role)[1] if recompute != "none" else b
    return f * r[0], b0 * r[1] + (b - b0) * r[2]


def optimizer_ratio(cal: ModuleCal | None, op, s: Strategy, cluster: Cluster, role: str) -> float:
    """The measured / analytical ratio of the layer's optimizer step (1 where its shape was not measured)."""
    r = cal.ratio(role != OUTSIDE, cal.key(op, s, cluster)) if cal is not None else None
    return 1.0 if r is None else r[3]


def source(cal: ModuleCal | None, op, s: Strategy, cluster: Cluster, role: str) -> str:
    """Which model priced a layer's compute: "module" (measured) or "analytical"."""
    if cal is None:
        return "analytical"
    return "module" if cal.ratio(role != OUTSIDE, cal.key(op, s, cluster)) is not None else "analytical"
