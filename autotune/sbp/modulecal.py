"""The step model's prices corrected by the user's own module, timed on one GPU (the profile's ``module``
section, ``calibrate.module``; measured by ``python -m calibrate module``).

The measured block is one whole transformer block; the step model prices layer by layer. Per measured
point (tensor width t, local micro-batch m, sequence s) the analytical model prices the same local block
on one device (the model's graph of one block with heads, K/V heads, MLP width and vocabulary divided by
t, micro-batch m: ``analytical``), and the ratio measured / analytical, per part (forward, backward,
recomputation, optimizer step, the bytes kept from the forward to the backward; the block, and the layers
outside the blocks; the parts timed alone scaled together to the step measured back to back where it was:
``step_scale``), scales every layer of that part whose strategy runs that local shape (``part_ratio``; the
activations not under full recomputation, which keeps of a block only its input). The step's measured peak
moves the plan's workspace by measured - modelled (``unit_peak``). So where the plan's layers run a
measured shape, the block's predicted seconds are the measured seconds exactly (a closed form: a block
measured at X s a micro-batch predicts X x blocks x micro-batches; with its step measured, L blocks at 2
micro-batches predict L x its step), and the analytical model's split of them over the block's layers is
kept (the search still compares strategies layer by layer). A layer's local shape: its output's local
rows over the sequence give the micro-batch, the rest of the output's split the tensor width; a layer
whose tensor width was not measured takes the nearest measured width's ratios (the same kernels on another
split: 2 x H200, 2026-11-30, GPT-2 medium's blocks measured at 2.4 / 1.7 times the analytical forward / backward at
width 1; priced analytically at width 2, a plan splitting the attention by heads looked 10% cheaper than data
parallelism and ran 27% slower); one whose shape no point can match (another sequence, a sequence split) keeps
its analytical price, and the plan's ``compute_source`` says per layer which ("module", "nearest" or
"analytical"). Between measured micro-batches of a width and sequence, the nearest on a log scale gives the ratio
(a ratio moves little with the micro-batch: the kernels are the same). Gradient accumulation, DTensor's local copies
and FSDP's communication stay analytical.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from calibrate.compute import ComputeModel
from calibrate.module import STEP_MICRO_BATCHES

from autotune.sbp.layers import Strategy, local_elems, make_op, with_recipe
from autotune.sbp.memory import NONE, OUTSIDE, chain_roles, layer_roles, peak_workspace, strategy_memory, tied_saving
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import accumulate_seconds, layer_seconds, local_elems_shape, optimizer_seconds

PARTS = ("forward", "backward", "recompute", "optimizer", "activations")


@dataclass(frozen=True)
class ModuleCal:
    """Per measured key (t, m, s): the ratios (``PARTS``: forward, backward, recompute, optimizer, activations)
    of the block and of the layers outside the blocks."""

    ratios: tuple  # ((t, m, s, inside: bool), (rf, rb, rr, ro, ra)) pairs
    sequence: int
    micro_batch: int  # the graph's global micro-batch
    peaks: tuple = ()  # ((t, m), bytes): the step's peak as measured less as modelled (``unit_peak``)
    transients: tuple = ()  # ((t, m), bytes): what a block holds at the forward's end beyond what it keeps

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

    def peak_offset(self, key) -> float:
        """Bytes the step's peak was measured above the memory model's at the local shape ``key`` (0 where not
        measured): the transients the model does not know of (the loss's, the backward's) in the user's module."""
        return next((b for k, b in self.peaks if k == key), 0.0)

    def forward_transient(self, key) -> float:
        """Bytes one block was measured to hold at the forward's end beyond what it keeps, at the local shape
        ``key`` (0 where not measured): a transformers model's key/value cache, alive until its output is freed."""
        return next((b for k, b in self.transients if k == key), 0.0)

    def ratio(self, inside: bool, key) -> tuple[float, ...] | None:
        """The ratios of the point nearest ``key`` (tensor width, micro-batch): its width's where measured, else
        the nearest measured width's (``nearest``), each on a log scale (the larger on a tie); None where the
        key is None or nothing was measured at the sequence."""
        if key is None:
            return None
        t, m = key
        found = [(k[0], k[1], r) for k, r in self.ratios if k[2] == self.sequence and k[3] == inside]
        if not found:
            return None
        return min(found, key=lambda x: (abs(math.log(x[0] / t)), -x[0], abs(math.log(x[1] / m)), -x[1]))[2]

    def measured(self, key) -> bool:
        """Whether ``key``'s tensor width was measured at the sequence (else its ratios are the nearest width's)."""
        return key is not None and any(k[0] == key[0] and k[2] == self.sequence for k, _ in self.ratios)


def one_device(layer, act_bytes: int):
    """(op, its one strategy on one device, in the users' recipe) of ``layer``."""
    op = make_op(layer, act_bytes)
    return op, with_recipe(op.strategies(Cluster(1, 1))[0], layer)


def analytical(op_roles_counts, cm: ComputeModel, act_bytes: int) -> tuple[list, list]:
    """(block, outside): the analytical ``PARTS`` (forward, backward, recompute, optimizer seconds; the bytes kept
    for the backward, ``strategy_memory``'s activations) and, last, the gradient accumulation's seconds of a
    micro-batch after the first, of one block's layers and of the layers outside the blocks of a one-device graph,
    each layer's one strategy on one device."""
    cl = Cluster(1, 1)
    block, outside = [0.0] * (len(PARTS) + 1), [0.0] * (len(PARTS) + 1)
    for layer, role, count in op_roles_counts:
        op, s = one_device(layer, act_bytes)
        f, b = layer_seconds(op, s, cl, cm, act_bytes, "none", role)
        _, bf = layer_seconds(op, s, cl, cm, act_bytes, "full", role)
        o = optimizer_seconds(s, cl, cm, act_bytes, NONE, bool(op.dims.get("tied", 0)) and layer.kind == "matmul")
        a = strategy_memory(s, cl, act_bytes, NONE, role).activations
        acc = outside if role == OUTSIDE else block
        for i, v in enumerate((f, b, bf - b, o, a, accumulate_seconds(s, cl, cm, act_bytes))):
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
    ratios, peaks, transients = {}, {}, {}
    for p in section.points:
        if p.sequence != c.get("sequence"):
            continue
        t = p.tensor
        local = dict(c, layers=1, heads=c["heads"] // t, kv_heads=c.get("kv_heads", c["heads"]) // t,
                     ffn=c["ffn"] // t, vocabulary=c["vocabulary"] // t, micro_batch=p.micro_batch,
                     batch=p.micro_batch, head_dim=c.get("head_dim", c["hidden"] // c["heads"]))
        g = BUILDERS[graph.model](local)
        block, outside = analytical(zip(g.layers, layer_roles(g), g.counts()), cm, graph.act_bytes)
        for inside, model, part in ((True, block, p.block), (False, outside, p.outside)):
            k = step_scale(part, model[-1])
            measured = (part["forward_s"] * k, part["backward_s"] * k,
                        part["recompute_s"] * k if part.get("recompute_s") is not None else None,
                        part["optimizer_s"] * k, part.get("activation_bytes"))
            r = [(m / a if m is not None and a > 0 else None) for m, a in zip(measured, model)]
            r[2] = r[2] if r[2] is not None else r[0]  # no recomputation measured: as the forward
            ratios[(t, p.micro_batch, p.sequence, inside)] = tuple(1.0 if x is None else x for x in r)
        transient = p.block.get("forward_transient_bytes") or 0.0
        if transient:
            transients[(t, p.micro_batch)] = transient
        if p.outside.get("peak_bytes") is not None:
            two = BUILDERS[graph.model](dict(local, batch=STEP_MICRO_BATCHES * p.micro_batch))
            act = {True: ratios[(t, p.micro_batch, p.sequence, True)][4],
                   False: ratios[(t, p.micro_batch, p.sequence, False)][4]}
            peaks[(t, p.micro_batch)] = p.outside["peak_bytes"] - unit_peak(two, graph.act_bytes, act, transient)
    if not ratios:
        return None
    return ModuleCal(tuple(sorted(ratios.items())), c["sequence"], graph.micro_batch, tuple(sorted(peaks.items())),
                     tuple(sorted(transients.items())))


def unit_peak(graph, act_bytes: int, act_ratio: dict, transient: float = 0.0) -> float:
    """The memory model's peak of a one-device step of ``graph`` (each layer's one strategy, its micro-batches
    accumulated) above the parameters and optimizer states: gradients, what is kept (the activations scaled by
    ``act_ratio``: inside a block -> ratio), and the workspace (``peak_workspace``, each block's forward
    ``transient`` at the forward's end), as ``Problem.memory_breakdown`` counts them (a tied logits weight placed
    as the embedding's: one gradient)."""
    cl = Cluster(1, 1)
    ops, strategies = zip(*(one_device(layer, act_bytes) for layer in graph.layers))
    embedding = next((v for v, layer in enumerate(graph.layers) if layer.kind == "embedding"), None)
    grads = kept = shared = 0.0
    for v, (op, s, role, count) in enumerate(zip(ops, strategies, layer_roles(graph), graph.counts())):
        tied = op.layer.kind == "matmul" and bool(op.dims.get("tied", 0)) and embedding is not None
        m = strategy_memory(s, cl, act_bytes, NONE, role, tied)
        grads += count * m.gradients
        kept += count * m.activations * act_ratio[role != OUTSIDE]
        if tied:
            shared += count * tied_saving(s, strategies[embedding], cl, act_bytes).gradients
    chain = [strategies[v] for v in graph.chain]
    return peak_workspace(chain, cl, act_bytes, graph.micro_batches, NONE, chain_roles(graph),
                          "autocast", shared, transient * len(graph.blocks)) + kept + grads - shared


def step_scale(part: dict, accumulate_s: float) -> float:
    """What the parts timed alone (forward, backward, optimizer) are scaled by so that ``STEP_MICRO_BATCHES``
    micro-batches of them, the analytical gradient accumulation and the optimizer's step add up to the step measured
    back to back (``step_s``): 1 where it was not measured (or is not above the accumulation)."""
    step = part.get("step_s")
    alone = STEP_MICRO_BATCHES * (part["forward_s"] + part["backward_s"]) + part["optimizer_s"]
    work = step - (STEP_MICRO_BATCHES - 1) * accumulate_s if step is not None else 0.0
    return work / alone if work > 0 and alone > 0 else 1.0


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


def part_ratio(cal: ModuleCal | None, part: str, op, s: Strategy, cluster: Cluster, role: str) -> float:
    """The measured / analytical ratio of one of the layer's ``PARTS`` ("optimizer": its step; "activations": the
    bytes it keeps for the backward), 1 where its shape was not measured."""
    r = cal.ratio(role != OUTSIDE, cal.key(op, s, cluster)) if cal is not None else None
    return 1.0 if r is None else r[PARTS.index(part)]


def source(cal: ModuleCal | None, op, s: Strategy, cluster: Cluster, role: str) -> str:
    """Which model priced a layer's compute: "module" (its local shape's width measured), "nearest" (the nearest
    measured width's ratios) or "analytical"."""
    if cal is None:
        return "analytical"
    key = cal.key(op, s, cluster)
    if cal.ratio(role != OUTSIDE, key) is None:
        return "analytical"
    return "module" if cal.measured(key) else "nearest"
