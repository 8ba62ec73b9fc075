"""The search problem: per (tied) layer its strategies, their costs and memory,
and the boxing costs between consecutive layers.

Cost of a plan, seconds per training step (the communication the profile predicts):
    redistribution = micro_batches * (boxing between consecutive layers, forward
                     and backward, plus boxing inside layers)
    gradient sync  = one all-reduce per weight over the axes where it is B while
                     the layer's input is split (once per step: gradient accumulation);
                     a tied logits layer whose weight is placed as the embedding's holds
                     one tensor with it, so one gradient: its sync is the embedding's
                     (``Problem.tied_sync``), where its sync axes are among the embedding's
Memory per device: parameters, gradients, optimizer states, one micro-batch's
activations and the workspace, accounted in ``autotune.sbp.memory``.

A ``Mode`` (``autotune.sbp.memory``) sets the recomputation and FSDP's sharding of
a problem: its memory, compute and communication follow (``Problem.with_mode``
shares the strategies and boxing tables). Under FSDP a sharded weight's gradient is
reduce-scattered per micro-batch (``steptime.fsdp_steps``) instead of all-reduced
once a step over its sharding axes; over its other sync axes (HSDP's replicas) its
shard is all-reduced once a step. Gradients are synced in the recipe's gradient
type under the step objective (``memory.Recipe.sync``: fp32 but in Megatron-LM's fp16 recipe) and in the activation
type under the communication objective (AutoDDL's, unchanged).

The memory limit is the device's (``device_limit``); the searches constrain the
per-layer sum to ``memory_limit`` = the device's less a ``reserve`` for the
workspace, which ``autotune.sbp.fit.search_fitting`` raises until the searched
plan fits with its workspace (``fits_plan``).
"""
from __future__ import annotations

import copy
import functools
import math

import numpy as np

from calibrate.errors import OptionError, UserError
from models.graph import LayerGraph

from autotune.sbp.boxing import Coster, Step, box, box_backward, copy_seconds
from autotune.sbp.layers import ACT_BYTES, NO_DROPOUT, Strategy, make_op, with_recipe
from autotune.sbp.memory import (NONE, OUTSIDE, RECIPES, RERUN, TAIL, Memory, Mode, chain_roles, layer_roles,
                                 edge_bytes, recipe_of,
                                 fsdp_axes, grad_sync_axes, held_elems, loss_parallel, peak_workspace, shares_tied_weight, strategy_memory, tied_saving)
from autotune.sbp.steptime import (accumulate_seconds, fsdp_seconds, matmul_kernel_seconds, optimizer_seconds,
                                   overlapped, require_compute)
from autotune.sbp.mesh import Cluster
from autotune.sbp.modulecal import calibrated_seconds, calibration, part_ratio
from autotune.sbp.rowbox import RowBoxer
from autotune.sbp.sbp import fine_of
from autotune.sbp.tables import EdgeTables, edge_steps  # noqa: F401 (edge_steps: re-exported)


@functools.lru_cache(maxsize=None)
def internal_steps(s: Strategy, cluster: Cluster) -> tuple[tuple[str, str, tuple[Step, ...]], ...]:
    """(tensor, direction, steps) of the boxing inside a layer, per micro-batch (pure, memoised)."""
    out = []
    for it in s.internal:
        src, dst = fine_of(it.src, s.mesh, cluster), fine_of(it.dst, s.mesh, cluster)
        out.append((it.tensor, it.direction, box(it.shape, it.itemsize, src, dst, cluster)))
        if it.backward:
            out.append((it.tensor, "bwd", box_backward(it.shape, it.itemsize, src, dst, cluster)))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def hidden_steps(s: Strategy, cluster: Cluster) -> tuple[tuple[Step, ...], ...]:
    """The steps of each boxing inside a layer that runs beside one of its backward GEMMs (``Internal.overlap``
    "dgrad" or "wgrad", each beside its own), per micro-batch (pure, memoised)."""
    return tuple(box(it.shape, it.itemsize, fine_of(it.src, s.mesh, cluster), fine_of(it.dst, s.mesh, cluster),
                     cluster) for it in s.internal if it.overlap)


# a collective step's op -> the profile's overlap figure for compute beside it (``ComputeModel.overlap_slowdown``)
OVERLAP_OF = {"allgather": "all_gather", "reducescatter": "reduce_scatter", "allreduce": "all_reduce"}


def internal_seconds(op, s: Strategy, cluster: Cluster, coster: Coster, cm=None, act_bytes: int = ACT_BYTES
                     ) -> tuple[float, float]:
    """Per micro-batch, (forward, backward) seconds of the boxing inside a layer on the critical path: each
    boxing whole, but one beside a backward GEMM (``hidden_steps``: Megatron-LM's asynchronous re-gather of a
    sequence-parallel input beside the input-gradient GEMM, and the reduce-scatter of the input's gradient beside the
    weight-gradient GEMM, each launched before its GEMM and waited for after it), with a compute model ``cm``, only
    what the GEMM (each the forward product's size: ``steptime.matmul_kernel_seconds``) does not hide, plus the
    GEMM's slowdown beside it (the profile's overlap figure for that collective): max(0, C - G) + (k - 1) min(C, G)."""
    f = sum(coster.time(st) for _, d, st in internal_steps(s, cluster) if d == "fwd")
    b = sum(coster.time(st) for _, d, st in internal_steps(s, cluster) if d != "fwd")
    hidden = hidden_steps(s, cluster)
    if hidden and cm is not None:
        gemm = matmul_kernel_seconds(op, s, cluster, cm, act_bytes)
        for steps in hidden:
            c = coster.time(steps)
            k = max((cm.overlap_slowdown(OVERLAP_OF[st.op]) for st in steps if st.op in OVERLAP_OF), default=1.0)
            b += max(0.0, c - gemm) + (k - 1.0) * min(c, gemm) - c
    return f, b


def internal_copy_seconds(s: Strategy, cluster: Cluster, cm) -> tuple[float, float]:
    """Per micro-batch, (forward, backward): DTensor's local copies around the boxing inside a layer
    (``boxing.copy_seconds``)."""
    out = [0.0, 0.0]
    for _, d, steps in internal_steps(s, cluster):
        out[d != "fwd"] += copy_seconds(steps, cm.memory_seconds)
    return out[0], out[1]


def sync_steps(s: Strategy, cluster: Cluster, itemsize: int = ACT_BYTES, mode: Mode = NONE) -> list[tuple[str, Step]]:
    """Once a step: each weight's gradient all-reduced over its sync axes (``grad_sync_axes``) less its FSDP
    axes (whose gradient is reduce-scattered per micro-batch instead), on what the device holds of it."""
    out = []
    for w in s.weights:
        sharded = fsdp_axes(s, w, cluster, mode)
        axes = tuple(a for a in grad_sync_axes(s, w, cluster) if a not in sharded)
        if axes:
            out.append((w.name, Step("allreduce", axes, round(held_elems(s, w, cluster, mode)) * itemsize)))
    return out


def forward_factors(graph: LayerGraph, blocks: int = 0) -> dict[tuple[int, int], float]:
    """Per edge, how many times its forward boxing runs per micro-batch under full recomputation, on
    average over its occurrences: twice where both ends lie in one re-run block (the block's forward re-run;
    ``blocks``: only the first that many blocks re-run, ``Mode.blocks``)."""
    roles = chain_roles(graph, blocks)
    block_of = [-1] * len(graph.chain)
    for i, (start, end) in enumerate(getattr(graph, "blocks", None) or []):
        for p in range(start, end):
            block_of[p] = i
    inside: dict[tuple[int, int], int] = {}
    for p in range(len(graph.chain) - 1):
        if roles[p] != OUTSIDE and roles[p + 1] != TAIL and block_of[p] == block_of[p + 1]:
            key = (graph.chain[p], graph.chain[p + 1])
            inside[key] = inside.get(key, 0) + 1
    counts = graph.edges()
    return {e: 1.0 + n / counts[e] for e, n in inside.items()}


OBJECTIVES = ("comm", "step")


def rows_of(graph: LayerGraph) -> int | None:
    """The micro-batch of a transformer, whose activations a user's module holds as (batch, sequence,
    features): the rows ``layer_strategies`` splits; None for other models."""
    return graph.micro_batch if "sequence" in graph.config else None


def layer_strategies(op, cluster: Cluster, signatures, rows: int | None, recipe: str = "autocast",
                     dropout: tuple[float, float] = NO_DROPOUT) -> list[Strategy]:
    """``op``'s strategies in ``recipe`` with ``dropout`` (``with_recipe``); with ``rows``, those whose input or
    output splits the tokens over devices that do not divide ``rows`` left out (apply cuts a micro-batch into whole
    sequences)."""
    out = [with_recipe(s, op.layer, recipe, op.act_bytes, dropout) for s in op.strategies(cluster, signatures)]
    return out if rows is None else [s for s in out if all(
        rows % math.prod(n for p, n in zip(f, cluster.axis_sizes) if p == "S0") == 0 for f in (s.fine_in, s.fine_out))]


class Catalogue:
    """What problems on one cluster and precision recipe share, made once: each layer's strategies (by layer,
    activation size and signatures) and the boxing tables (one ``RowBoxer`` that keeps them, per activation size
    and objective). A pipeline's stage problems hold the same layers on one submesh (``autotune.pipeline.search``).
    ``dropout``: Megatron-LM's (on the attention probabilities, on the hidden states), in its recipes only
    (``layers.with_recipe``)."""

    def __init__(self, coster: Coster, recipe: str = "autocast", dropout: tuple[float, float] = NO_DROPOUT):
        recipe_of(recipe)
        self.coster, self.recipe, self.dropout = coster, recipe, tuple(dropout)
        self.strategies: dict[tuple, list[Strategy]] = {}
        self.rows: dict[tuple, RowBoxer] = {}
        self.figures: dict[tuple, np.ndarray] = {}  # per (layer, figure): one value per strategy (``Problem._figures``)

    @staticmethod
    def key(op, signatures, rows=None) -> tuple:
        return op.layer, op.act_bytes, signatures, rows

    def layer_strategies(self, op, signatures, rows=None) -> list[Strategy]:
        key = Catalogue.key(op, signatures, rows)
        out = self.strategies.get(key)
        if out is None:
            out = self.strategies[key] = layer_strategies(op, self.coster.cluster, signatures, rows, self.recipe,
                                                          self.dropout)
        return out

    def boxer(self, itemsize: int, memory_seconds) -> RowBoxer:
        key = (itemsize, memory_seconds is not None)
        if key not in self.rows:
            self.rows[key] = RowBoxer(self.coster, itemsize, memory_seconds, keep_tables=True)
        return self.rows[key]


class Problem:
    """Variables are the distinct layers (repeated layers tied); choices their strategies."""

    def __init__(self, graph: LayerGraph, coster: Coster, memory_limit: float | None = None,
                 signatures=None, allow_partial: bool = True, progress=None,
                 precompute_tables: bool | None = None, require_fit: bool = True, objective: str = "comm",
                 mode: Mode = NONE, recipe: str | None = None, keep=None, catalogue: Catalogue | None = None,
                 runnable: bool = True):
        """``runnable``: only the strategies apply runs (``layer_strategies``' rows), else every one (a plan
        priced, not run: Megatron's sequence parallelism). ``keep``: a predicate ``keep(layer, strategy)``; the strategies it rejects are left out (e.g. a cap
        on weight replication). ``require_fit``: raise a UserError when even the least-memory plan exceeds ``memory_limit``;
        without it, check ``fits`` (a baseline with no plan under the limit is reported, not fatal).
        ``objective``: "comm", seconds of communication per step (AutoDDL's), or "step", predicted step
        time (``autotune.sbp.steptime``; needs the profile's compute model). ``mode``: recomputation and
        FSDP (``autotune.sbp.memory.Mode``). ``recipe`` (default: the catalogue's, else "autocast"): the
        precision recipe (``autotune.sbp.memory.RECIPES``): "autocast", the one users run, or Megatron-LM's
        "megatron-fp16" / "megatron-bf16" (a plan fits at its peak, workspace included), or "autoddl", the
        paper's (fp16 weights and gradients with an fp32 master; a plan fits by the per-layer sum, as the
        paper's search checks it: the AutoDDL reproduction's). ``catalogue``: strategies and boxing tables
        shared with other problems on the same ``coster`` and recipe (``Catalogue``)."""
        if catalogue is not None and catalogue.coster is not coster:
            raise UserError("a problem's catalogue must be made on its own coster")
        self.catalogue = catalogue
        recipe = recipe or (catalogue.recipe if catalogue is not None else "autocast")
        if recipe not in RECIPES or catalogue is not None and catalogue.recipe != recipe:
            raise UserError(f"recipe {recipe!r}: use one of {', '.join(RECIPES)}, the catalogue's own if it has one")
        self.recipe = recipe
        if objective not in OBJECTIVES:
            raise UserError(f"unknown objective {objective!r}: use one of {', '.join(OBJECTIVES)}")
        self.objective = objective
        self.graph, self.coster, self.cluster = graph, coster, coster.cluster
        self.act_bytes = graph.act_bytes
        self.ops = [make_op(layer, self.act_bytes) for layer in graph.layers]
        self.counts = graph.counts()
        self.edge_counts = graph.edges()
        self.mb = graph.micro_batches
        self.device_limit = memory_limit
        self.reserve = 0.0
        self.choices: list[list[Strategy]] = []
        self._layer_keys: list[tuple | None] = []  # the catalogue's key of a layer whose choices are its strategies
        rows = rows_of(graph) if runnable else None
        for op in self.ops:
            ss = list(catalogue.layer_strategies(op, signatures, rows)) if catalogue is not None else \
                layer_strategies(op, self.cluster, signatures, rows, recipe)
            whole = len(ss)
            if not allow_partial:
                ss = [s for s in ss if not s.uses_partial]
            if keep is not None:
                ss = [s for s in ss if keep(op.layer, s)]
            self._layer_keys.append(Catalogue.key(op, signatures, rows) if catalogue is not None and len(ss) == whole
                                    else None)
            if not ss:
                raise UserError(
                    f"layer {op.layer.name} has no strategy on {self.cluster} (sizes do not divide): "
                    f"pick a batch, micro-batch or hidden size divisible by the device count"
                )
            self.choices.append(ss)
        if progress:
            progress(f"{len(self.ops)} distinct layers, {sum(map(len, self.choices))} strategies, "
                     f"search space 10^{sum(math.log10(len(c)) for c in self.choices):.1f}")
        self.compute = coster.profile.compute
        self.module_cal = None
        if objective == "step":
            require_compute(coster.profile)
            # the user's module as measured, if it was (under autocast: a main-gradient recipe's modules are not it)
            self.module_cal = None if recipe_of(recipe, self.act_bytes).main_grad else calibration(graph, coster.profile)
        self.first = graph.chain[0]  # its gradients are ready last: their sync is never hidden
        self.chain_roles = chain_roles(graph)
        self.roles = layer_roles(graph)
        self.embedding = next((v for v, op in enumerate(self.ops) if op.layer.kind == "embedding"), None)
        # the layers whose strategies say which measured transients of the user's module a plan holds
        # (``memory_breakdown``): the attention's heads split (its key/value cache), the loss's vocabulary
        self.attention = next((v for v, op in enumerate(self.ops) if op.layer.kind == "attention"), self.embedding)
        self.loss = next((v for v, op in enumerate(self.ops) if op.layer.kind == "loss"), None)
        # a logits layer sharing the embedding's weight, both in this problem (a pipeline stage without the
        # embedding holds the weight as its own parameter, with its optimizer states, as Megatron does)
        self.tied = [op.layer.kind == "matmul" and bool(op.dims.get("tied", 0)) and self.embedding is not None
                     for op in self.ops]
        tied_logits = [v for v, t in enumerate(self.tied) if t]
        # (logits, embedding) when the logits share the embedding's weight once in the graph: one sync of both
        self.tied_pair = (tied_logits[0], self.embedding) if len(tied_logits) == 1 and self.embedding is not None \
            and self.counts[tied_logits[0]] == 1 and self.counts[self.embedding] == 1 else None
        self.incident: list[list[tuple[tuple[int, int], int]]] = [[] for _ in self.ops]
        for (a, b), c in self.edge_counts.items():
            self.incident[a].append(((a, b), c))
            if b != a:
                self.incident[b].append(((a, b), c))
        self._precompute, self._progress = precompute_tables, progress
        self.tables = None
        self._shared: dict = {}  # per-strategy figures and mode problems, shared with ``with_mode``'s copies
        self._price_mode(mode)
        if require_fit:
            self.require_fit()
        # adjacent distinct layers (u < v): the blocks of a joint two-layer move
        self.pairs = sorted({(min(a, b), max(a, b)) for a, b in self.edge_counts if a != b})
        self.evaluations = 0
        self.derived: dict = {}  # what other modules compute from the problem once (e.g. a strategy index)

    def _price(self, mode: Mode) -> None:
        """The costs and memory of every strategy under ``mode``, and the boxing tables (shared where the mode
        does not change them). Per-strategy figures are made once per layer (``_figures``): for this problem
        and its mode copies, and, with a ``Catalogue``, for every problem on the catalogue's cluster that has the
        layer with the same strategies (a pipeline's stage problems: the same block layers in stages of
        different lengths)."""
        if mode.recompute == "full" and not getattr(self.graph, "blocks", None):
            raise OptionError("recompute", f"full: model {self.graph.model} has no transformer blocks to recompute")
        self.mode = mode
        cl, ab, mb = self.cluster, self.act_bytes, self.mb
        step = self.objective == "step"
        grad_bytes = recipe_of(self.recipe, ab).sync if step else ab
        self.grad_bytes = grad_bytes
        rec = mode.recompute
        fig = self._figures
        self.node_redist = []
        for v, ss in enumerate(self.choices):
            redo = rec == "full" and self.roles[v] in RERUN
            # per strategy: forward and backward seconds of the boxing inside the layer (on the critical path)
            cm = self.compute if step else None
            inner = fig(v, ("internal", cm is not None), lambda ss=ss, v=v, cm=cm: np.array(
                [internal_seconds(self.ops[v], s, cl, self.coster, cm, ab) for s in ss]).reshape(len(ss), 2))
            self.node_redist.append(mb * ((2 if redo else 1) * inner[:, 0] + inner[:, 1]))
        self.node_sync = [fig(v, ("sync", grad_bytes, mode), lambda ss=ss: np.array(
            [sum(self.coster.step_time(st) for _, st in sync_steps(s, cl, grad_bytes, mode)) for s in ss], dtype=float))
            for v, ss in enumerate(self.choices)]
        self.tied_sync = self._tied_sync_table(grad_bytes, mode) if self.tied_pair else None
        self.node_compute = self.node_fwd = self.node_bwd = None
        fsdp = mode.fsdp_axes is not None
        # the backward's slowdown beside the gradient sync's collectives (DDP: all-reduces; FSDP: reduce-scatters)
        self.sync_slowdown = self.compute.overlap_slowdown("reduce_scatter" if fsdp else "all_reduce") \
            if step and self.compute is not None else 1.0
        secs = None
        if self.compute is not None:
            cm = self.compute
            secs = []
            for v, (op, ss) in enumerate(zip(self.ops, self.choices)):
                role = self.roles[v]
                # (one model's problems share a catalogue: one profile, one module calibration)
                secs.append(fig(v, ("secs", self._recomputed(v), role),
                                lambda op=op, ss=ss, role=role: np.array(
                    [calibrated_seconds(self.module_cal, op, s, cl, cm, ab, rec, role) for s in ss],
                    dtype=float).reshape(len(ss), 2)))
            self.node_compute = []
            for v, (sec, ss) in enumerate(zip(secs, self.choices)):
                redo = 2 if rec == "full" and self.roles[v] in RERUN else 1
                copies = fig(v, ("copies",), lambda ss=ss: np.array([sum(internal_copy_seconds(s, cl, cm)) for s in ss],
                                                                    dtype=float))
                opt = fig(v, ("optimizer", mode, self.tied[v]), lambda ss=ss, v=v: np.array(
                    [optimizer_seconds(s, cl, cm, ab, mode, self.tied[v])
                     * part_ratio(self.module_cal, "optimizer", self.ops[v], s, cl, self.roles[v]) for s in ss],
                    dtype=float))
                acc = fig(v, ("accumulate", mode), lambda ss=ss: np.array(
                    [accumulate_seconds(s, cl, cm, ab, mode) for s in ss], dtype=float))
                self.node_compute.append(mb * (sec[:, 0] + sec[:, 1] + redo * copies) + opt + (mb - 1) * acc)
            self.node_fwd, self.node_bwd = [sec[:, 0] for sec in secs], [sec[:, 1] for sec in secs]
        if fsdp:  # exposed under the step objective, all of it under the communication objective
            for v, ss in enumerate(self.choices):
                if step and secs:
                    key = ("fsdp", mode, self._recomputed(v), self.roles[v])
                    extra = fig(v, key, lambda ss=ss, sec=secs[v]: np.array(
                        [fsdp_seconds(s, cl, self.coster, mode, f, b) for s, (f, b) in zip(ss, sec)], dtype=float))
                else:
                    extra = fig(v, ("fsdp", mode), lambda ss=ss: np.array(
                        [fsdp_seconds(s, cl, self.coster, mode, None, None) for s in ss], dtype=float))
                self.node_redist[v] = self.node_redist[v] + mb * extra
        if self.objective == "comm":
            self.node = [c * (r + g).astype(float) for c, r, g in zip(self.counts, self.node_redist, self.node_sync)]
        else:
            self.node = [c * (r + k) for c, r, k in zip(self.counts, self.node_redist, self.node_compute)]
            self.sync_tot = [c * g for c, g in zip(self.counts, self.node_sync)]
            self.bwd_tot = [c * b for c, b in zip(self.counts, self.node_bwd)]
        self._price_memory(mode)
        self._set_tables(forward_factors(self.graph) if rec == "full" else {})

    def _set_tables(self, factors: dict) -> None:
        """The boxing tables with ``factors`` (``forward_factors``: each edge's forward boxing re-run), shared
        by the mode copies with the same factors."""
        step, ab, mb = self.objective == "step", self.act_bytes, self.mb
        old = self.tables
        key = ("tables", tuple(sorted(factors.items())))  # the mode copies with these factors share one
        if old is not None and old.forward_factor != factors and key in self._shared:
            self.tables = self._shared[key]
        elif old is None or old.forward_factor != factors:
            copies = self.compute.memory_seconds if step else None
            kinds = [op.layer.kind for op in self.ops]
            sent = (lambda a, b: edge_bytes(kinds[a], kinds[b], ab)) if step and self.recipe == "autocast" else ab
            self.tables = EdgeTables(self.choices, [op.out_shape for op in self.ops], self.edge_counts, self.coster,
                                     mb, self._precompute if old is None else old.precomputed,
                                     self._progress if old is None else None, sent, copies, factors,
                                     old.boxer if old is not None else (lambda size: self.catalogue.boxer(size, copies))
                                     if self.catalogue is not None else None)
        self._shared.setdefault(key, self.tables)

    # the per-layer figures block recomputation mixes (``_price_mode``): sums over a layer's occurrences
    MIXED = ("node_redist", "node_compute", "node_fwd", "node_bwd", "node", "sync_tot", "bwd_tot")

    def _price_mode(self, mode: Mode) -> None:
        """``_price`` of ``mode``; under Megatron-LM's block recomputation (``mode.blocks``: the first of the
        problem's blocks re-run) the per-layer figures of every block re-run and of none, weighted by the share
        of blocks re-run (each is a sum over the layer's occurrences, one a block, re-run or not), the boxing
        re-run in the re-run blocks only, and the memory as ``layer_memory`` and ``chain_roles`` count it."""
        self.chain_roles = chain_roles(self.graph, mode.blocks)
        if not mode.blocks:
            self._price(mode)
            return
        n = len(getattr(self.graph, "blocks", None) or [])
        if mode.blocks >= n:
            raise OptionError("recompute", f"blocks {mode.blocks}: model {self.graph.model} has {n} blocks here; "
                                           f"re-run fewer, or all of them (full recomputation)")
        self._price(mode.whole)
        whole = {name: getattr(self, name, None) for name in self.MIXED}
        self._price(mode.plain)
        w = self.rerun_share(mode)
        for name, a in whole.items():
            if a is not None:
                setattr(self, name, [w * x + (1 - w) * y for x, y in zip(a, getattr(self, name))])
        self.mode = mode
        self._price_memory(mode)
        self._set_tables(forward_factors(self.graph, mode.blocks))

    def rerun_share(self, mode: Mode) -> float:
        """The share of the problem's blocks ``mode`` re-runs under block recomputation, 0 under any other mode
        (a key of its figures beside the mode: the catalogue's are shared by stages of other lengths)."""
        return mode.blocks / len(self.graph.blocks) if mode.blocks else 0.0

    def rerun(self, v: int, figure):
        """``figure(mode)`` of layer ``v`` under the problem's mode: under block recomputation the share of its
        occurrences that re-run at the mode's ``whole``, the rest at its ``plain`` (``figure``'s value: a number,
        an array or a ``Memory``)."""
        mode = self.mode
        if not mode.blocks or self.roles[v] == OUTSIDE:
            return figure(mode)
        w = self.rerun_share(mode)
        a, b = figure(mode.whole), figure(mode.plain)
        return a.scaled(w) + b.scaled(1 - w) if isinstance(a, Memory) else w * a + (1 - w) * b

    def _recomputed(self, v: int) -> str:
        """The recomputation that changes layer ``v``'s seconds under the mode being priced: the mode's where it
        re-runs some of the layer, else "none" (the key its figures share with the plain problem's)."""
        rec, role = self.mode.recompute, self.roles[v]
        changed = (rec == "full" and role != OUTSIDE) or (rec == "selective" and self.ops[v].layer.kind == "attention")
        return rec if changed else "none"

    def _price_memory(self, mode: Mode) -> None:
        """``mem`` (bytes per device of each strategy's occurrences, ``autotune.sbp.memory``) and its least."""
        measured, share = self.module_cal is not None, self.rerun_share(mode)
        self.mem = [c * self._figures(v, ("memory", mode, share, self.roles[v], self.tied[v], self.recipe, measured),
                                      lambda ss=ss, v=v: np.array([self.layer_memory(v, s).total for s in ss]))
                    for v, (c, ss) in enumerate(zip(self.counts, self.choices))]
        self.min_memory = float(sum(m.min() for m in self.mem))
        self._min_memory_assignment = [int(np.argmin(m)) for m in self.mem]

    def _figures(self, v: int, what: tuple, make) -> np.ndarray:
        """A per-strategy figure of layer ``v`` (``what``: its name and what it depends on beside the layer and
        its strategies), made once: in the catalogue, per layer, where this problem's choices of ``v`` are the
        catalogue's strategies of the layer and its coster is the catalogue's (shared by every problem on that
        cluster), else in this problem's family (``_shared``)."""
        layer = self._layer_keys[v]
        if layer is not None and self.catalogue.coster is self.coster:
            store, key = self.catalogue.figures, (layer,) + what
        else:
            store, key = self._shared, (v,) + what
        out = store.get(key)
        if out is None:
            out = store[key] = make()
        return out

    def shared(self, key, make):
        """What another module computes once from the strategies alone (e.g. a strategy index): ``make()``'s
        value, made once and shared by this problem, its modes (``with_mode``) and its other copies."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def _tied_sync_table(self, grad_bytes: int, mode: Mode) -> np.ndarray:
        """Seconds of gradient sync a plan saves, per (logits strategy, embedding strategy), where the tied logits'
        weight is placed as the embedding's (``shares_tied_weight``: one tensor, whose gradient sums both uses)
        and the logits' sync axes are among the embedding's: the embedding's sync then reduces the sum, and the
        logits' own all-reduce of the weight's gradient is not made (0 elsewhere)."""
        t, e = self.tied_pair
        cl = self.cluster

        def weight_sync(s) -> tuple[float, frozenset]:
            steps = [st for name, st in sync_steps(s, cl, grad_bytes, mode) if name == "weight"]
            return (sum(self.coster.step_time(st) for st in steps),
                    frozenset(a for st in steps for a in st.axes))

        logits = [weight_sync(s) for s in self.choices[t]]
        emb_axes = [weight_sync(s)[1] for s in self.choices[e]]
        out = np.zeros((len(self.choices[t]), len(self.choices[e])))
        for i, (secs, axes) in enumerate(logits):
            if secs <= 0:
                continue
            for j, se in enumerate(self.choices[e]):
                if axes <= emb_axes[j] and shares_tied_weight(self.choices[t][i], se, cl, mode):
                    out[i, j] = secs
        return out

    def tied_saved(self, assign, v: int | None = None) -> np.ndarray | float:
        """The tied logits' sync saved (``tied_sync``) by a plan, or, for layer ``v``, for every choice of it
        with the others fixed (0 without a tied pair)."""
        if self.tied_pair is None:
            return 0.0
        t, e = self.tied_pair
        if v == t:
            return self.tied_sync[:, assign[e]]
        if v == e:
            return self.tied_sync[assign[t], :]
        return float(self.tied_sync[assign[t], assign[e]])

    def tied_saved_pair(self, assign, u: int, v: int) -> np.ndarray | float:
        """``tied_saved`` for every pair of choices of layers ``u`` and ``v``, the others fixed: an array that
        broadcasts to |choices u| x |choices v|."""
        if self.tied_pair is None:
            return 0.0
        t, e = self.tied_pair
        if (u, v) == (t, e):
            return self.tied_sync
        if (u, v) == (e, t):
            return self.tied_sync.T
        if t in (u, v) or e in (u, v):
            line = self.tied_saved(assign, u if u in (t, e) else v)
            return line[:, None] if u in (t, e) else line[None, :]
        return self.tied_saved(assign)

    def with_mode(self, mode: Mode) -> "Problem":
        """The same problem under another recomputation / FSDP ``mode`` (strategies and, where the mode does
        not change them, boxing tables shared); made once per mode and problem family, then reused."""
        if mode == self.mode:
            return self
        modes = self._shared.setdefault("modes", {self.mode: self})
        out = modes.get(mode)
        if out is None:
            out = copy.copy(self)
            out.derived = {}
            out.evaluations = 0
            out.reserve = 0.0
            out._price_mode(mode)
            modes[mode] = out
        return out

    def mode_problems(self) -> list["Problem"]:
        """This problem and every mode made from it (``with_mode``) so far."""
        return list(self._shared.get("modes", {self.mode: self}).values())

    @property
    def memory_limit(self) -> float | None:
        """What the searches constrain the per-layer sum to: the device's limit less the workspace reserve."""
        return None if self.device_limit is None else self.device_limit - self.reserve

    @memory_limit.setter
    def memory_limit(self, value: float | None) -> None:
        """A new device limit, no reserve."""
        self.device_limit, self.reserve = value, 0.0

    @property
    def fits(self) -> bool:
        """Whether some plan fits the memory limit."""
        return self.memory_limit is None or self.min_memory <= self.memory_limit

    def require_fit(self) -> None:
        if not self.fits:
            raise OptionError(
                "memory_limit", f"{self.device_limit / 2**30:.1f} GiB per device: no plan fits it, the smallest "
                                f"needs {self.min_memory / 2**30:.1f} GiB; raise it, add devices or shrink the micro-batch")

    # whether the plan runs the user's own forward and loss (the step ``calibrate module`` measured, its transients
    # with it), not a pipeline stage's cut of the model (``autotune.pipeline.stage.StageProblem``)
    users_step = True

    def memory_breakdown(self, assign, cached_gathered: bool = True) -> Memory:
        """Parameters, gradients, optimizer states, activations and the peak's workspace per device of a plan
        (a tied logits layer's copy dropped where its weight is placed as the embedding's); ``cached_gathered``:
        ``peak_workspace``'s (False on the DTensor path)."""
        out = Memory()
        shared = 0.0
        for v, (i, c) in enumerate(zip(assign, self.counts)):
            s = self.choices[v][i]
            m = self.layer_memory(v, s)
            if self.tied[v] and self.embedding is not None:
                saved = tied_saving(s, self.choices[self.embedding][assign[self.embedding]], self.cluster,
                                    self.act_bytes, self.mode, self.recipe)
                m = Memory(m.parameters - saved.parameters, m.gradients - saved.gradients, m.optimizer,
                           m.activations)
                shared += saved.gradients * c
            out = out + m.scaled(c)
        offset = transient = 0.0
        mode = self.mode
        if self.module_cal is not None and self.embedding is not None and self.users_step \
                and (mode.recompute != "full" or mode.blocks):
            e = self.embedding  # the transients the user's module was measured to hold beyond the model's
            key = self.module_cal.key(self.ops[e], self.choices[e][assign[e]], self.cluster)
            # measured with the module's own loss on its local vocabulary: not the loss of logits split by
            # vocabulary (torch's loss_parallel, priced as measured: memory.LOSS_PARALLEL_KEPT)
            split = self.loss is not None and loss_parallel(self.choices[self.loss][assign[self.loss]])
            offset = 0.0 if split else self.module_cal.peak_offset(key)
            # a block's transient (its key/value cache) at the block's local shape: its heads split as the
            # attention's are; none where apply re-runs a block or its attention (``apply.layers._rerun``)
            a = self.attention
            at = self.module_cal.key(self.ops[a], self.choices[a][assign[a]], self.cluster)
            blocks = len(self.graph.blocks) - mode.blocks if mode.recompute == "none" or mode.blocks else 0
            transient = self.module_cal.forward_transient(at) * blocks
        ws = peak_workspace([self.choices[v][assign[v]] for v in self.graph.chain], self.cluster, self.act_bytes,
                            self.mb, self.mode, self.chain_roles, self.recipe, shared, transient, cached_gathered)
        return Memory(out.parameters, out.gradients, out.optimizer, out.activations, ws + offset)

    def layer_memory(self, v: int, s: Strategy) -> Memory:
        """One occurrence of layer ``v`` under strategy ``s`` (``strategy_memory``), its activations as the user's
        module keeps them where it was measured at the layer's local shape (``modulecal.part_ratio``; not for a
        block's layers under full recomputation, which keep the block's input only); under block recomputation
        the share re-run as that, the rest as without (``rerun``)."""
        return self.rerun(v, lambda mode: self._layer_memory(v, s, mode))

    def _layer_memory(self, v: int, s: Strategy, mode: Mode) -> Memory:
        m = strategy_memory(s, self.cluster, self.act_bytes, mode, self.roles[v], self.tied[v], self.recipe)
        if mode.recompute == "full" and self.roles[v] != OUTSIDE:
            return m
        r = part_ratio(self.module_cal, "activations", self.ops[v], s, self.cluster, self.roles[v])
        return m if r == 1.0 else Memory(m.parameters, m.gradients, m.optimizer, m.activations * r, m.workspace)

    def peak_memory(self, assign) -> float:
        """Bytes per device at a plan's peak: ``memory_breakdown``'s total, the workspace included."""
        return self.memory_breakdown(assign).total

    def fits_plan(self, assign, peak: float | None = None) -> bool:
        """Whether a plan fits the device's memory limit at its peak (the one fit check of plans; the "autoddl"
        recipe: by the per-layer sum, the paper's). ``peak``: the plan's peak as priced on the path apply places
        it by (``autotune.plan.build``: the DTensor path keeps no gathered weights' casts), else
        ``peak_memory``'s."""
        if self.device_limit is None:
            return True
        if self.recipe == "autoddl":
            return self.memory_of(assign) <= self.device_limit
        return (self.peak_memory(assign) if peak is None else peak) <= self.device_limit

    @property
    def sizes(self) -> list[int]:
        return [len(c) for c in self.choices]

    def edge_cost(self, a: int, b: int, sa: int, sb: int) -> float:
        """Seconds per step of boxing layer a's output (strategy sa) into layer b's input (sb), once."""
        return self.tables.pair(a, b, sa, sb)

    def edge_matrix(self, a: int, b: int) -> np.ndarray:
        return self.tables.table(a, b)

    def forget_lazy(self) -> None:
        self.tables.forget_lazy()

    def memory_of(self, assign) -> float:
        return float(sum(m[s] for m, s in zip(self.mem, assign)))

    def feasible(self, assign) -> bool:
        return self.memory_limit is None or self.memory_of(assign) <= self.memory_limit

    def sync_parts(self, assign) -> tuple[float, float, float]:
        """(S, W, F) of ``steptime``'s rule: the step's gradient sync, the last micro-batch's backward that may
        hide it, the first layer's sync (ready only when the backward ends)."""
        S = sum(float(self.counts[v] * self.node_sync[v][i]) for v, i in enumerate(assign)) - self.tied_saved(assign)
        W = sum(float(self.counts[v] * self.node_bwd[v][i]) for v, i in enumerate(assign))
        return S, W, float(self.node_sync[self.first][assign[self.first]])

    def exposed_sync(self, assign) -> float:
        """Gradient sync not hidden behind the last micro-batch's backward: max(S - W, F) (``steptime``)."""
        return float(overlapped(*self.sync_parts(assign), self.sync_slowdown))

    def _extra(self, assign, v: int) -> np.ndarray | float:
        """The non-additive part of the step objective for every choice of layer v, the others fixed."""
        S = sum(self.sync_tot[u][i] for u, i in enumerate(assign) if u != v) + self.sync_tot[v] \
            - self.tied_saved(assign, v)
        W = sum(self.bwd_tot[u][i] for u, i in enumerate(assign) if u != v) + self.bwd_tot[v]
        F = self.node_sync[self.first] if v == self.first else self.node_sync[self.first][assign[self.first]]
        return overlapped(S, W, F, self.sync_slowdown)

    def raw_cost(self, assign) -> float:
        """The objective's seconds per step, the memory limit ignored."""
        total = sum(n[s] for n, s in zip(self.node, assign))
        for (a, b), c in self.edge_counts.items():
            total += c * self.edge_cost(a, b, assign[a], assign[b])
        if self.objective == "step":
            total += self.exposed_sync(assign)
        else:
            total -= self.tied_saved(assign)
        return float(total)

    def cost(self, assign) -> float:
        """Seconds of communication per step; inf if over the memory limit."""
        self.evaluations += 1
        if not self.feasible(assign):
            return math.inf
        return self.raw_cost(assign)

    def local(self, assign, v: int) -> np.ndarray:
        """The part of the cost that depends on layer v, for every choice of v, the others fixed
        (its own costs and its incident boxings; table lookups)."""
        out, t = self.node[v], self.tables
        for (a, b), c in self.incident[v]:
            line = t.diagonal(a) if a == b else t.column(a, b, assign[b]) if a == v else t.row(a, b, assign[a])
            out = out + (line if c == 1 else c * line)
        if self.objective == "step":
            out = out + self._extra(assign, v)
        elif self.tied_pair is not None and v in self.tied_pair:
            out = out - self.tied_saved(assign, v)
        return out

    def pair_local(self, assign, u: int, v: int) -> np.ndarray:
        """The part of the cost that depends on adjacent layers u and v, for every pair of their
        choices, the others fixed: a |choices u| x |choices v| array (the boxing table between
        them plus each layer's other incident lines); inf where the plan exceeds the memory limit.
        Reads whole tables: meant for problems whose tables are precomputed (``tables.precomputed``).
        What depends on one layer alone is summed as a vector first, so the full array takes a few passes:
        the joint table, the outer sum of the two vectors, the step objective's exposed sync (``overlapped``, as
        ``_extra``) and the mask."""
        t = self.tables
        lines = {u: self.node[u], v: self.node[v]}
        joint = None
        for w in (u, v):
            for (a, b), c in self.incident[w]:
                if {a, b} == {u, v}:
                    if w == u:  # the joint edge, once
                        m = t.table(u, v) if a == u else t.table(v, u).T
                        joint = m if c == 1 else c * m
                    continue
                line = t.diagonal(a) if a == b else t.column(a, b, assign[b]) if a == w else t.row(a, b, assign[a])
                lines[w] = lines[w] + (line if c == 1 else c * line)
        out = lines[u][:, None] + lines[v][None, :]
        if joint is not None:
            out += joint
        if self.objective == "step":  # ``_extra`` over the pair: S, W and F of every pair of choices
            rest = [w for w in range(len(assign)) if w not in (u, v)]
            S = np.add.outer(sum(float(self.sync_tot[w][assign[w]]) for w in rest) + self.sync_tot[u],
                             self.sync_tot[v]) - self.tied_saved_pair(assign, u, v)
            W = np.add.outer(sum(float(self.bwd_tot[w][assign[w]]) for w in rest) + self.bwd_tot[u], self.bwd_tot[v])
            F = self.node_sync[u][:, None] if self.first == u else self.node_sync[v][None, :] \
                if self.first == v else self.node_sync[self.first][assign[self.first]]
            out += overlapped(S, W, F, self.sync_slowdown)
        elif self.tied_pair is not None and {u, v} & set(self.tied_pair):
            out = out - self.tied_saved_pair(assign, u, v)
        if self.memory_limit is not None:
            rest_mem = self.memory_of(assign) - self.mem[u][assign[u]] - self.mem[v][assign[v]]
            np.putmask(out, self._pair_memory(u, v) > self.memory_limit - rest_mem, math.inf)
        return out

    def _pair_memory(self, u: int, v: int) -> np.ndarray:
        """The memory of every pair of choices of layers u and v, made once per problem (``derived``: its copies,
        whose memory may differ, start without it)."""
        key = ("pair memory", u, v)
        if key not in self.derived:
            self.derived[key] = np.add.outer(self.mem[u], self.mem[v])
        return self.derived[key]

    def memory_mask(self, assign, v: int) -> np.ndarray | None:
        """Which choices of layer v keep the plan within the memory limit (None: no limit)."""
        if self.memory_limit is None:
            return None
        rest = self.memory_of(assign) - self.mem[v][assign[v]]
        return rest + self.mem[v] <= self.memory_limit

    def candidates(self, assign, v: int) -> np.ndarray:
        """Total cost for every choice of layer v, the others fixed (inf where memory is exceeded)."""
        self.evaluations += len(self.choices[v])
        out = self.local(assign, v)  # with the step objective's non-additive part
        rest = sum(n[s] for i, (n, s) in enumerate(zip(self.node, assign)) if i != v)
        rest += sum(c * self.edge_cost(a, b, assign[a], assign[b]) for (a, b), c in self.edge_counts.items()
                    if a != v and b != v)
        if self.objective != "step" and (self.tied_pair is None or v not in self.tied_pair):
            rest -= self.tied_saved(assign)
        out = out + rest
        mask = self.memory_mask(assign, v)
        if mask is not None:
            out[~mask] = math.inf
        return out

    def min_memory_assignment(self) -> list[int]:
        return list(self._min_memory_assignment)

    def random_assignment(self, rng: np.random.Generator, tries: int = 200) -> list[int]:
        """A random assignment within the memory limit (falls back to the least memory one)."""
        for _ in range(tries):
            a = [int(rng.integers(n)) for n in self.sizes]
            if self.feasible(a):
                return a
        return self.min_memory_assignment()
