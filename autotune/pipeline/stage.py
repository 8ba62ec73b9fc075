"""One pipeline stage as an SBP problem: its sub-graph on its submesh, the memory of the micro-batches
its schedule keeps in flight, and the figures the pipeline's step model takes from its plan.

Memory per device of a stage that keeps ``inflight`` micro-batches' activations (1F1B: stage i of p
keeps p - i, GPipe all m, eager-1F1B 2(p - i) - 1, at most m; ``autotune.reshard.pipeline``): the
parameters, gradients and optimizer states of its layers once, the activations of one micro-batch
(``autotune.sbp.memory``) ``inflight`` times, plus the peak's workspace.

Autocast's weight copies, in the users' recipe: torch's schedule runs every micro-batch of the step in the one
``torch.autocast`` context the step is under (``autotune.apply_pipeline``'s ``Pipeline.step``), and autocast's cache
keeps each weight's bf16 copy from its first cast until that context ends. So a stage's forward casts its weights in
the first micro-batch only, and its micro-batches in flight share one copy, where a step with a context per
micro-batch (the single-stage step, ``calibrate module``) casts each time and keeps a copy per micro-batch
(``one_cast``; 2 x H200, 2026-11-30, clearing the cache before each micro-batch's forward: a 16-layer Mistral's
first stage 47.03 -> 50.20 GiB, its forwards 15 ms a step more; reports/records/plans_h200x2.md, session 27). Not
in FSDP mode, whose stages keep the per-micro-batch figures (not measured); under full recomputation the re-run
forwards' casts are priced as without a pipeline (not measured).

Per micro-batch, a stage's forward (backward) is the sum over its layer occurrences of their forward
(backward) compute (``autotune.sbp.steptime``), the boxing inside them that runs in that pass and the
boxing between consecutive layers in that direction, each boxing with its local copies; the gradient
accumulation after each micro-batch but the first is spread over the backward passes ((m - 1) / m of it
each), and the forward casts saved (above) over the forwards. Once per step: the gradient all-reduce
(exposed as in the single-stage model: max(S - W, F), ``Problem.exposed_sync``) and the optimizer.
m (forward + backward) + optimizer + exposed sync is the stage's ``Problem`` cost under the step objective
(tested), under its recomputation and FSDP mode too, with the user's module as measured (``modulecal``).

A stage in FSDP mode runs as torchtitan runs it (``autotune.apply.pipeline``: the ``FSDPModule`` handed to
``PipelineStage``, resharding after backward and gradient sync off until the last micro-batch; the gloo tests
count its collectives), not as a single-stage FSDP plan (``steptime.fsdp_steps`` per micro-batch). With m
micro-batches, k = min(inflight, m) of them forwarded before the stage's first backward, per step and
occurrence of a layer whose weights FSDP shards (AG: their fp32 all-gather, RS: their gradients' fp32
reduce-scatter, f and b: the layer's forward and backward compute; ``StageProblem.gathers``,
``steptime.pipelined_fsdp_seconds``):

    a block's layer (a fully_shard unit, resharded after each forward)
        k max(0, AG - f) + (m - k + 1) max(0, AG - b)      the first forward, each pass after a forward
    a layer outside the blocks (the root unit, kept gathered)
        max(0, AG - f)                                      its first forward
    grad sync += RS, exposed whole                          after the last backward (REDUCE_GRAD), unhidden

spread evenly over the micro-batches' forwards and backwards in ``StageFigures`` (m (forward + backward)
holds them all); no reduce-scatter per micro-batch. Memory per occurrence (``memory.pipelined_fsdp_memory``):
the fp32 shards of its weights (fully_shard has no MixedPrecisionPolicy here), outside the blocks (the root
unit, kept gathered) the whole weights too, the whole fp32 gradients (accumulated unsharded from the first
backward: ``accumulate_seconds`` of the whole weight), the shards' optimizer states, activations per in-flight
micro-batch as above; the workspace as without FSDP plus the blocks' gathered weights
(``StageProblem._gathered``: in a backward the blocks already run stay gathered as their activations go).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from calibrate.errors import UserError

from autotune.pipeline.paths import host_floor
from autotune.sbp.boxing import copy_seconds
from autotune.sbp.cost import Catalogue, Problem, forward_factors, internal_copy_seconds, internal_seconds, rows_of
from autotune.sbp.layers import COLUMN_SP, UNIT_ROLE, local_elems, make_op
from autotune.sbp.memory import (OUTSIDE, RERUN, Memory, Mode, edge_bytes, gathered_weight_bytes, peak_workspace,
                                  kept_copy_bytes, pipelined_fsdp_memory, recipe_of, strategy_memory, tied_saving)
from autotune.sbp.modulecal import calibrated_seconds, part_ratio
from autotune.sbp.steptime import (accumulate_seconds, fsdp_seconds, optimizer_seconds, pipelined_fsdp_seconds,
                                   weight_cast_seconds)
from autotune.sbp.tables import edge_steps


class StageProblem(Problem):
    """A ``Problem`` whose memory counts ``inflight`` micro-batches' activations (``in_flight`` makes a copy
    with another count that shares the costs and boxing tables)."""

    def __init__(self, graph, coster, memory_limit, objective: str = "step", inflight: int = 1,
                 pipelined: bool = True, **kw):
        """``pipelined`` False: the stage is the whole model run without a pipeline (FSDP as the single-stage
        plan runs it: ``PipelineConfig.single_stage_plain``)."""
        self.inflight, self.pipelined = inflight, pipelined
        super().__init__(graph, coster, memory_limit, require_fit=False, objective=objective, **kw)

    @property
    def users_step(self) -> bool:
        """A pipeline's stage runs the cut of the model (``autotune.apply.cuts``: no key/value cache, the stage's
        loss), not the user's forward and loss: the module's measured transients are not its (``Problem``)."""
        return not self.pipelined

    @property
    def pipelined_fsdp(self) -> bool:
        """Whether the stage runs FSDP as torchtitan does (its mode shards weights, in a pipeline): then its
        gathers, its reduce-scatter and its memory are the module doc's, not the single-stage plan's."""
        return self.pipelined and self.mode.fsdp_axes is not None

    @property
    def one_cast(self) -> bool:
        """Whether autocast's bf16 copies of the weights are made once a step and shared by the micro-batches in
        flight (module doc): a pipeline's stage in the users' recipe, not in FSDP mode."""
        return self.pipelined and self.recipe == "autocast" and self.mode.fsdp_axes is None

    def _cast_once(self) -> None:
        """The forward's weight casts of every micro-batch but the first taken off the stage's compute
        (``one_cast``): (m - 1) x each layer's forward cast a step, (m - 1) / m of it a micro-batch's forward."""
        m, ab, cl, cm = self.mb, self.act_bytes, self.cluster, self.compute
        for v, ss in enumerate(self.choices):
            key = ("forward cast", self.roles[v], self.module_cal is not None)
            cast = self._figures(v, key, lambda ss=ss, v=v: np.array(
                [forward_cast_seconds(self.module_cal, self.ops[v], s, cl, cm, ab, self.roles[v]) for s in ss]))
            self.node_compute[v] = self.node_compute[v] - (m - 1) * cast
            self.node_fwd[v] = self.node_fwd[v] - (m - 1) / m * cast
        self.node = [c * (r + k) for c, r, k in zip(self.counts, self.node_redist, self.node_compute)]

    def _copies(self, assign) -> float:
        """The bytes of autocast's weight copies of plan ``assign`` a ``one_cast`` stage holds once, not per
        micro-batch in flight (0 for any other stage; none of a block's layers under full recomputation)."""
        if not self.one_cast:
            return 0.0
        return sum(c * self.rerun(v, lambda mode, s=self.choices[v][i], v=v: kept_copy_bytes(
            s, self.cluster, self.act_bytes, mode, self.roles[v])) for v, (i, c) in enumerate(zip(assign, self.counts)))

    def _price(self, mode: Mode) -> None:
        """``Problem._price``; in FSDP mode under the step objective its per-micro-batch FSDP communication
        replaced by the stage's (module doc): the forward and backward all-gathers' exposed seconds per gather
        (``_gathers``, which the in-flight count multiplies: ``_set_inflight``), one reduce-scatter a step in the
        gradient sync, none of which the last backward hides (W = 0 in ``Problem.exposed_sync``); the gradients
        accumulated unsharded."""
        self._gathers = None
        super()._price(mode)
        if self.one_cast and self.objective == "step" and self.compute is not None:
            self._cast_once()
        if not (self.pipelined_fsdp and self.objective == "step" and self.compute is not None):
            return
        cl, cm, ab, mb = self.cluster, self.compute, self.act_bytes, self.mb
        base, gathers, sync, compute = [], [], [], []
        whole = Mode(mode.recompute)  # the gradients accumulate unsharded
        for v, ss in enumerate(self.choices):
            role, rec = self.roles[v], self._recomputed(v)
            secs = self._figures(v, ("secs", rec, role), lambda: None)
            old = self._figures(v, ("fsdp", mode, rec, role), lambda: None)
            acc = self._figures(v, ("accumulate", mode), lambda: None)
            unsharded = self._figures(v, ("accumulate", whole), lambda ss=ss: np.array(
                [accumulate_seconds(s, cl, cm, ab, whole) for s in ss], dtype=float))
            compute.append(self.node_compute[v] + (mb - 1) * (unsharded - acc))
            parts = self._figures(v, ("pipelined fsdp", mode, rec, role), lambda ss=ss, secs=secs: np.array(
                [pipelined_fsdp_seconds(s, cl, self.coster, mode, f, b) for s, (f, b) in zip(ss, secs)],
                dtype=float).reshape(len(ss), 3))
            base.append(self.node_redist[v] - mb * old)
            gathers.append((parts[:, 0], parts[:, 1], role == OUTSIDE))
            sync.append(self.node_sync[v] + parts[:, 2])
        self._redist_base, self._gathers = base, gathers
        self.node_sync, self.node_compute = sync, compute
        self.sync_tot = [c * g for c, g in zip(self.counts, sync)]
        self.node_bwd = [np.zeros(len(ss)) for ss in self.choices]
        self.bwd_tot = [np.zeros(len(ss)) for ss in self.choices]
        self._set_inflight(self.inflight)

    def gathers(self, k: int | None = None) -> tuple[int, int, int]:
        """Per step under FSDP as torchtitan runs it, with ``k`` (default: the problem's) micro-batches in
        flight: (the forward, the backward all-gathers of a block's layer, the forward all-gathers of a layer
        outside the blocks). A block is a fully_shard unit resharded after each forward: the stage's first
        forward gathers it, and every pass that follows a forward (the warm-up's k - 1 forwards, then each
        backward after a forward: the first backward and the m - k that follow the steady state's forwards),
        k forward and m - k + 1 backward gathers; the layers outside the blocks are the root unit, gathered
        once (its first forward) and kept until the step's end."""
        k = min(self.inflight if k is None else k, self.mb)
        return k, self.mb - k + 1, 1

    def _price_memory(self, mode) -> None:
        """The memory per strategy split into what the in-flight count multiplies (made once per layer, as
        ``Problem._figures`` keeps per-strategy figures: ``with_mode`` copies and the catalogue's other
        problems share them); in FSDP mode torchtitan's (``pipelined_fsdp_memory``)."""
        fsdp = self.pipelined and mode.fsdp_axes is not None
        once = self.one_cast

        def price(v, s):
            if fsdp:
                return pipelined_fsdp_memory(s, self.cluster, self.act_bytes, mode, self.roles[v], self.tied[v],
                                             self.recipe)
            return self.layer_memory(v, s)

        def parts(v):  # (one micro-batch in flight, what each further one adds: its activations less shared copies)
            return np.array([(m.total, m.activations - (self.rerun(v, lambda md, s=s: kept_copy_bytes(
                                 s, self.cluster, self.act_bytes, md, self.roles[v])) if once else 0.0))
                             for s in self.choices[v] for m in (price(v, s),)],
                            dtype=float).reshape(len(self.choices[v]), 2)
        what = "pipelined fsdp memory parts" if fsdp else "memory parts"
        measured = self.module_cal is not None
        share = self.rerun_share(mode)
        split = [self._figures(v, (what, mode, share, self.roles[v], self.tied[v], self.recipe, once, measured),
                               lambda v=v: parts(v)) for v in range(len(self.choices))]
        self._total = [p[:, 0] for p in split]
        self._acts = [p[:, 1] for p in split]
        self._set_inflight(self.inflight)

    def _set_inflight(self, k: int) -> None:
        self.inflight = k
        self.mem = [c * (t + (k - 1) * a) for c, t, a in zip(self.counts, self._total, self._acts)]
        self.min_memory = float(sum(m.min() for m in self.mem))
        self._min_memory_assignment = [int(np.argmin(m)) for m in self.mem]
        if self._gathers is not None:  # torchtitan's FSDP: the gathers a step depend on k (``_price`` set them)
            nf, nb, root = self.gathers(k)
            self.node_redist = [r + (root * gf if out else nf * gf + nb * gb)
                                for r, (gf, gb, out) in zip(self._redist_base, self._gathers)]
            self.node = [c * (r + q) for c, r, q in zip(self.counts, self.node_redist, self.node_compute)]

    def in_flight(self, k: int) -> "StageProblem":
        if k == self.inflight:
            return self
        out = copy.copy(self)
        out.derived = {}
        out.reserve = 0.0
        out._set_inflight(k)
        return out

    def shared_key(self, what: tuple) -> tuple:
        """The key of a figure the in-flight copies share: with the in-flight count where it changes the figure
        (FSDP as torchtitan runs it: the gathers a step)."""
        return what + (self.inflight,) if self._gathers is not None else what

    def max_inflight(self, assign) -> float:
        """The most micro-batches in flight under which plan ``assign`` fits the device's memory at its peak,
        workspace included (``fits_plan``; 0: none; inf: no limit, or its activations take no memory)."""
        if self.device_limit is None:
            return math.inf
        m, shared = self.memory_breakdown(assign), self._copies(assign)
        acts = (m.activations - shared) / self.inflight
        if acts <= 0:
            return math.inf if m.total <= self.device_limit else 0
        k = max(int((self.device_limit - (m.total - m.activations + shared)) // acts), 0)
        while k > 0 and not self.in_flight(k).fits_plan(assign):  # the closed form's rounding, both ways
            k -= 1
        while self.in_flight(k + 1).fits_plan(assign):
            k += 1
        return k

    def memory_breakdown(self, assign, cached_gathered: bool = True) -> Memory:
        """``Problem.memory_breakdown`` with the activations of ``inflight`` micro-batches, autocast's weight
        copies once where the stage shares them (``one_cast``; one micro-batch's breakdown made once per mode and
        plan, shared by the in-flight copies)."""
        m = self.shared(("breakdown", self.mode, tuple(assign), cached_gathered),
                        lambda: self._one_breakdown(assign, cached_gathered))
        shared = self._copies(assign)
        return Memory(m.parameters, m.gradients, m.optimizer, (m.activations - shared) * self.inflight + shared,
                      m.workspace)

    def _one_breakdown(self, assign, cached_gathered: bool = True) -> Memory:
        """One micro-batch's breakdown: ``Problem.memory_breakdown``'s; in FSDP mode torchtitan's (module doc):
        each layer's ``pipelined_fsdp_memory``, the tied logits' copy dropped, the workspace as without FSDP
        (the gradients whole) plus the blocks' gathered weights (``_gathered``); in a pipeline, the schedule's own
        tensors in the workspace (``schedule_bytes``)."""
        m = self._layers_breakdown(assign, cached_gathered)
        return Memory(m.parameters, m.gradients, m.optimizer, m.activations, m.workspace + self.schedule_bytes(assign))

    def schedule_bytes(self, assign) -> float:
        """What torch.distributed.pipelining holds beyond the stage's layers (2 x H200, 2026-11-30: the allocator's
        history of a transformers Llama's two stages; reports/records/plans_h200x2.md, session 26). First, a
        receive buffer for each of the step's micro-batches: for the input of a stage after the first, and for
        the output's gradient of a stage before the last. They are made when the schedule first runs and kept
        (16 x 128 MiB on each stage there). Second, on the last stage, its output (the logits), which the
        schedule keeps for the micro-batch's backward, past the loss's. The boundary is the residual stream, in
        fp32 under autocast (``edge_bytes``). Only in the users' recipe, the one ``autotune.apply_pipeline`` runs on
        torch's schedules (Megatron-LM's receive a tensor per transfer, and its loss keeps no logits)."""
        if not self.pipelined or self.recipe != "autocast":
            return 0.0
        first, last = self.graph.chain[0], self.graph.chain[-1]
        sf, sl = self.choices[first][assign[first]], self.choices[last][assign[last]]
        fwd, bwd = edge_bytes("residual", "residual", self.act_bytes)
        out = 0.0
        if self.embedding is None and sf.input is not None:  # a stage after the first
            out += self.mb * local_elems(sf.input, sf.mesh, self.cluster) * fwd
        if self.loss is None and sl.output is not None:  # a stage before the last
            out += self.mb * local_elems(sl.output, sl.mesh, self.cluster) * bwd
        if self.loss is not None:  # the logits, the loss's input
            s = self.choices[self.loss][assign[self.loss]]
            out += local_elems(s.input, s.mesh, self.cluster) * self.act_bytes
        return out

    def _layers_breakdown(self, assign, cached_gathered: bool = True) -> Memory:
        if not self.pipelined_fsdp:
            return Problem.memory_breakdown(self, assign, cached_gathered)
        plain = Mode(self.mode.recompute)
        out, shared = Memory(), 0.0
        for v, (i, c) in enumerate(zip(assign, self.counts)):
            s = self.choices[v][i]
            m = pipelined_fsdp_memory(s, self.cluster, self.act_bytes, self.mode, self.roles[v], self.tied[v],
                                      self.recipe)
            if self.tied[v] and self.embedding is not None:
                emb = self.choices[self.embedding][assign[self.embedding]]
                saved = tied_saving(s, emb, self.cluster, self.act_bytes, plain, self.recipe)  # the whole copy and gradient
                m = Memory(m.parameters - tied_saving(s, emb, self.cluster, self.act_bytes, self.mode, self.recipe).parameters
                           - saved.parameters, m.gradients - saved.gradients, m.optimizer, m.activations)
                shared += saved.gradients * c
            out = out + m.scaled(c)
        ws = peak_workspace([self.choices[v][assign[v]] for v in self.graph.chain], self.cluster, self.act_bytes,
                            self.mb, plain, self.chain_roles, self.recipe, shared)
        return Memory(out.parameters, out.gradients, out.optimizer, out.activations, ws + self._gathered(assign))

    def _gathered(self, assign) -> float:
        """The blocks' gathered weights at the peak (fp32, whole: ``gathered_weight_bytes``). A
        block's unit is gathered for its forward (the next one prefetched) and resharded after it; in a backward
        the blocks already run stay gathered (resharding after backward off) while their activations of that
        micro-batch are freed: with G_b and A_b block b's gathered weights and one micro-batch's activations,
        max over b of (G_b + ... + G_last) + G_(b-1) - (A_(b+1) + ... + A_last), at least the two largest
        G (a forward's)."""
        g, a = [], []
        for start, end in self.graph.blocks:
            picked = [(p, self.graph.chain[p]) for p in range(start, end)]
            g.append(sum(gathered_weight_bytes(self.choices[v][assign[v]], self.cluster, self.mode) for _, v in picked))
            a.append(sum(strategy_memory(self.choices[v][assign[v]], self.cluster, self.act_bytes, self.mode,
                                         self.chain_roles[p], self.tied[v], self.recipe).activations
                         for p, v in picked))
        two = sum(sorted(g)[-2:])
        return max([two] + [sum(g[b:]) + (g[b - 1] if b else 0.0) - sum(a[b + 1:]) for b in range(len(g))])


class Layout:
    """A stage's layers and each one's strategies on its submesh, unpriced (what ``Problem`` would choose
    from, the same objects: they come from the submesh's ``Catalogue``): where a fixed plan such as
    Megatron's (``autotune.sbp.baselines.megatron_assignment``, which reads ``graph``, ``ops``, ``choices``,
    ``cluster`` and ``shared``) is picked before any strategy is priced."""

    def __init__(self, graph, catalogue: Catalogue, runnable: bool = True, megatron: bool = False):
        """``runnable``: only the strategies apply runs (``autotune.sbp.cost.layer_strategies``), else all;
        ``megatron``: a matmul's strategies only on the meshes Megatron's layouts use (``layers.UNIT_ROLE``), and,
        in a Megatron-LM recipe, its column-parallel layer under sequence parallelism (``layers.COLUMN_SP``)."""
        self.graph, self.cluster, self.catalogue, self.runnable = graph, catalogue.coster.cluster, catalogue, runnable
        self.recipe = catalogue.recipe
        self.signatures = None if not megatron else (UNIT_ROLE, COLUMN_SP) if recipe_of(self.recipe).main_grad \
            else (UNIT_ROLE,)
        self.ops = [make_op(layer, graph.act_bytes) for layer in graph.layers]
        self.choices = [catalogue.layer_strategies(op, self.signatures, rows_of(graph) if runnable else None)
                        for op in self.ops]
        for op, ss in zip(self.ops, self.choices):
            if not ss:  # as ``Problem`` says it
                raise UserError(f"layer {op.layer.name} has no strategy on {self.cluster} (sizes do not divide): "
                                f"pick a batch, micro-batch or hidden size divisible by the device count")
        self._shared: dict = {}

    def shared(self, key, make):
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def fixed(self, assign, memory_limit, objective: str = "step") -> StageProblem:
        """The stage problem whose layers have the one strategy ``assign`` picks each (a layer's choices are
        the picked strategies of its occurrences): its figures for that plan are the full problem's
        (the same per-strategy cost and memory functions), at the price of one strategy a layer."""
        picked = {id(self.choices[v][i]) for v, i in enumerate(assign)}
        return StageProblem(self.graph, self.catalogue.coster, memory_limit, objective, catalogue=self.catalogue,
                            keep=lambda layer, s: id(s) in picked, runnable=self.runnable, signatures=self.signatures)


def forward_cast_seconds(cal, op, s, cluster, cm, act_bytes: int, role: str) -> float:
    """A layer occurrence's forward cast of its weights a micro-batch (``steptime.weight_cast_seconds``), scaled as
    the module's forward ratio scales its forward where it was measured (``modulecal.part_ratio``)."""
    return weight_cast_seconds(s, cluster, cm, act_bytes)[0] * part_ratio(cal, "forward", op, s, cluster, role)


@dataclass(frozen=True)
class StageFigures:
    """A stage plan's times (seconds) and memory (bytes per device)."""

    forward: float       # per micro-batch
    backward: float      # per micro-batch
    compute: float       # per step: compute, copies, optimizer and accumulation
    redistribution: float  # per step: boxing between and inside layers
    grad_sync: float     # per step: the gradient all-reduces
    exposed_sync: float  # the part of grad_sync not hidden behind the last backward
    optimizer: float
    memory: float        # peak, with the in-flight activations
    fits: bool
    path: str = ""       # the path apply places the plan by, where the profile has host figures (``paths``)
    host: float = 0.0    # the host's seconds to issue a micro-batch's forward and backward on that path


def figures(problem: StageProblem, assign) -> StageFigures:
    """Under the problem's mode (``autotune.sbp.memory.Mode``): full recomputation re-runs a block's forward
    (its compute, the boxing inside its layers and between them) in the backward pass; FSDP's all-gathers and
    reduce-scatters not hidden behind a layer's own compute (``steptime.fsdp_seconds``) add to the pass they
    run in; in FSDP mode torchtitan's (module doc): the all-gathers of a step spread evenly over its micro-batches'
    passes, the reduce-scatter in the gradient sync. The times are made once per mode and plan, shared by the
    problem's in-flight copies (in FSDP mode per in-flight count: ``StageProblem.shared_key``); the memory is
    the copy's. Where the profile has host figures, the host's floor of the plan's path
    (``autotune.pipeline.paths.host_floor``)."""
    times = problem.shared(problem.shared_key(("times", problem.mode, tuple(assign))), lambda: _times(problem, assign))
    return host_floor(StageFigures(*times, problem.peak_memory(assign), problem.fits_plan(assign)), problem, assign)


def _times(problem: StageProblem, assign) -> tuple[float, ...]:
    """``StageFigures``' times: forward, backward, compute, redistribution, grad sync, exposed sync, optimizer;
    under block recomputation the share of blocks re-run at every block re-run, the rest at none (each time a
    sum over the blocks)."""
    mode = problem.mode
    if not mode.blocks:
        return _mode_times(problem, assign, mode)
    w = problem.rerun_share(mode)
    return tuple(w * a + (1 - w) * b for a, b in zip(_mode_times(problem, assign, mode.whole),
                                                     _mode_times(problem, assign, mode.plain)))


def _mode_times(problem: StageProblem, assign, mode: Mode) -> tuple[float, ...]:
    cl, cm, m = problem.cluster, problem.compute, problem.mb
    full = mode.recompute == "full"
    factors = forward_factors(problem.graph) if full else {}
    fwd = bwd = comp = red = opt = 0.0
    block_f, block_b, root = problem.gathers()
    for v, (op, i, c) in enumerate(zip(problem.ops, assign, problem.counts)):
        s = problem.choices[v][i]
        role = problem.roles[v]
        redo = 1 if full and role in RERUN else 0
        # priced as the problem prices them: the user's module as measured where it was (``modulecal``)
        f, b = calibrated_seconds(problem.module_cal, op, s, cl, cm, problem.act_bytes, mode.recompute, role)
        if problem.one_cast:  # the weights cast in the first micro-batch's forward only (``_cast_once``)
            f -= (m - 1) / m * forward_cast_seconds(problem.module_cal, op, s, cl, cm, problem.act_bytes, role)
        acc = accumulate_seconds(s, cl, cm, problem.act_bytes, Mode(mode.recompute) if problem.pipelined_fsdp
                                 else mode) * (m - 1) / m
        o = optimizer_seconds(s, cl, cm, problem.act_bytes, mode, problem.tied[v]) \
            * part_ratio(problem.module_cal, "optimizer", op, s, cl, role)
        fwd, bwd, comp, opt = fwd + c * f, bwd + c * (b + acc), comp + c * (m * (f + b + acc) + o), opt + c * o
        tf, tb = internal_seconds(op, s, cl, problem.coster, cm, problem.act_bytes)
        kf, kb = internal_copy_seconds(s, cl, cm)
        # recomputed: the forward boxing again, and the local copies again (both passes', as ``Problem`` prices them)
        fwd, bwd = fwd + c * (tf + kf), bwd + c * (tb + kb + redo * (tf + kf + kb))
        comp, red = comp + c * m * (1 + redo) * (kf + kb), red + c * m * ((1 + redo) * tf + tb)
        if problem.pipelined_fsdp:  # the step's gathers spread over its micro-batches; the reduce-scatter: sync
            gf, gb, _ = pipelined_fsdp_seconds(s, cl, problem.coster, mode, f, b)
            nf, nb = (root, 0) if role == OUTSIDE else (block_f, block_b)
            fwd, bwd, red = fwd + c * nf * gf / m, bwd + c * nb * gb / m, red + c * (nf * gf + nb * gb)
        elif mode.fsdp_axes is not None:  # the whole model without a pipeline: the single-stage plan's FSDP
            x = fsdp_seconds(s, cl, problem.coster, mode, f, b)  # per micro-batch (``Problem``'s), with its backward
            bwd, red = bwd + c * x, red + c * m * x
    for (a, b), c in problem.edge_counts.items():
        sa, sb = problem.choices[a][assign[a]], problem.choices[b][assign[b]]
        (tf, kf), (tb, kb) = [(problem.coster.time(st), copy_seconds(st, cm.memory_seconds))
                              for st in edge_steps(sa, sb, problem.ops[a].out_shape, cl, problem.tables.sizes(a, b))]
        again = factors.get((a, b), 1.0) - 1.0  # the forward boxing re-run in the backward pass
        fwd, bwd = fwd + c * (tf + kf), bwd + c * (again * (tf + kf) + tb + kb)
        comp, red = comp + c * m * ((1 + again) * kf + kb), red + c * m * ((1 + again) * tf + tb)
    sync = sum(float(c * problem.node_sync[v][i]) for v, (i, c) in enumerate(zip(assign, problem.counts))) \
        - problem.tied_saved(assign)
    return fwd, bwd, comp, red, sync, problem.exposed_sync(assign), opt
