"""One pipeline stage as an SBP problem: its sub-graph on its submesh, the memory of the micro-batches
its schedule keeps in flight, and the figures the pipeline's step model takes from its plan.

Memory per device of a stage that keeps ``inflight`` micro-batches' activations (1F1B: stage i of p
keeps p - i, GPipe all m, eager-1F1B 2(p - i) - 1, at most m; ``autotune.reshard.pipeline``): the
parameters, gradients and optimizer states of its layers once, the activations of one micro-batch
(``autotune.sbp.memory``) ``inflight`` times, plus the peak's workspace.

Per micro-batch, a stage's forward (backward) is the sum over its layer occurrences of their forward
(backward) compute (``autotune.sbp.steptime``), the boxing inside them that runs in that pass and the
boxing between consecutive layers in that direction, each boxing with its local copies; the gradient
accumulation after each micro-batch but the first is spread over the backward passes ((m - 1) / m of it
each). Once per step: the gradient all-reduce (exposed as in the single-stage model: max(S - W, F),
``Problem.exposed_sync``) and the optimizer. m (forward + backward) + optimizer + exposed sync is the
stage's ``Problem`` cost under the step objective (tested), under its recomputation and FSDP mode too.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from calibrate.errors import UserError

from autotune.sbp.boxing import copy_seconds
from autotune.sbp.cost import Catalogue, Problem, forward_factors, internal_steps
from autotune.sbp.layers import make_op
from autotune.sbp.memory import RERUN, Memory, strategy_memory
from autotune.sbp.steptime import accumulate_seconds, fsdp_steps, layer_seconds, optimizer_seconds
from autotune.sbp.tables import edge_steps


class StageProblem(Problem):
    """A ``Problem`` whose memory counts ``inflight`` micro-batches' activations (``in_flight`` makes a copy
    with another count that shares the costs and boxing tables)."""

    def __init__(self, graph, coster, memory_limit, objective: str = "step", inflight: int = 1, **kw):
        self.inflight = inflight
        super().__init__(graph, coster, memory_limit, require_fit=False, objective=objective, **kw)

    def _price_memory(self, mode) -> None:
        """The memory per strategy split into what the in-flight count multiplies (made once per layer, as
        ``Problem._figures`` keeps per-strategy figures: ``with_mode`` copies and the catalogue's other
        problems share them)."""
        def parts(v):
            return np.array([(m.total, m.activations) for m in (
                strategy_memory(s, self.cluster, self.act_bytes, mode, self.roles[v], self.tied[v], self.recipe)
                for s in self.choices[v])], dtype=float).reshape(len(self.choices[v]), 2)
        split = [self._figures(v, ("memory parts", mode, self.roles[v], self.tied[v], self.recipe),
                               lambda v=v: parts(v)) for v in range(len(self.choices))]
        self._total = [p[:, 0] for p in split]
        self._acts = [p[:, 1] for p in split]
        self._set_inflight(self.inflight)

    def _set_inflight(self, k: int) -> None:
        self.inflight = k
        self.mem = [c * (t + (k - 1) * a) for c, t, a in zip(self.counts, self._total, self._acts)]
        self.min_memory = float(sum(m.min() for m in self.mem))
        self._min_memory_assignment = [int(np.argmin(m)) for m in self.mem]

    def in_flight(self, k: int) -> "StageProblem":
        if k == self.inflight:
            return self
        out = copy.copy(self)
        out.derived = {}
        out.reserve = 0.0
        out._set_inflight(k)
        return out

    def max_inflight(self, assign) -> float:
        """The most micro-batches in flight under which plan ``assign`` fits the device's memory at its peak,
        workspace included (``fits_plan``; 0: none; inf: no limit, or its activations take no memory)."""
        if self.device_limit is None:
            return math.inf
        m = self.memory_breakdown(assign)
        acts = m.activations / self.inflight
        if acts <= 0:
            return math.inf if m.total <= self.device_limit else 0
        k = max(int((self.device_limit - (m.total - m.activations)) // acts), 0)
        while k > 0 and not self.in_flight(k).fits_plan(assign):  # the closed form's rounding, both ways
            k -= 1
        while self.in_flight(k + 1).fits_plan(assign):
            k += 1
        return k

    def memory_breakdown(self, assign) -> Memory:
        """``Problem.memory_breakdown`` with the activations of ``inflight`` micro-batches (one micro-batch's
        breakdown made once per mode and plan, shared by the in-flight copies)."""
        m = self.shared(("breakdown", self.mode, tuple(assign)), lambda: Problem.memory_breakdown(self, assign))
        return Memory(m.parameters, m.gradients, m.optimizer, m.activations * self.inflight, m.workspace)


class Layout:
    """A stage's layers and each one's strategies on its submesh, unpriced (what ``Problem`` would choose
    from, the same objects: they come from the submesh's ``Catalogue``): where a fixed plan such as
    Megatron's (``autotune.sbp.baselines.megatron_assignment``, which reads ``graph``, ``ops``, ``choices``,
    ``cluster`` and ``shared``) is picked before any strategy is priced."""

    def __init__(self, graph, catalogue: Catalogue):
        self.graph, self.cluster, self.catalogue = graph, catalogue.coster.cluster, catalogue
        self.ops = [make_op(layer, graph.act_bytes) for layer in graph.layers]
        self.choices = [catalogue.layer_strategies(op, None) for op in self.ops]
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
                            keep=lambda layer, s: id(s) in picked)


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


def figures(problem: StageProblem, assign) -> StageFigures:
    """Under the problem's mode (``autotune.sbp.memory.Mode``): full recomputation re-runs a block's forward
    (its compute, the boxing inside its layers and between them) in the backward pass; FSDP's all-gathers and
    reduce-scatters not hidden behind a layer's own compute (``steptime.fsdp_seconds``) add to the pass they
    run in. The times do not depend on the micro-batches in flight: made once per mode and plan, shared by the
    problem's in-flight copies; the memory is the copy's."""
    times = problem.shared(("times", problem.mode, tuple(assign)), lambda: _times(problem, assign))
    return StageFigures(*times, problem.peak_memory(assign), problem.fits_plan(assign))


def _times(problem: StageProblem, assign) -> tuple[float, ...]:
    """``StageFigures``' times: forward, backward, compute, redistribution, grad sync, exposed sync, optimizer."""
    cl, cm, m, mode = problem.cluster, problem.compute, problem.mb, problem.mode
    full = mode.recompute == "full"
    factors = forward_factors(problem.graph) if full else {}
    fwd = bwd = comp = red = opt = 0.0
    for v, (op, i, c) in enumerate(zip(problem.ops, assign, problem.counts)):
        s = problem.choices[v][i]
        role = problem.roles[v]
        redo = 1 if full and role in RERUN else 0
        f, b = layer_seconds(op, s, cl, cm, problem.act_bytes, mode.recompute, role)
        acc = accumulate_seconds(s, cl, cm, problem.act_bytes, mode) * (m - 1) / m
        o = optimizer_seconds(s, cl, cm, problem.act_bytes, mode, problem.tied[v])
        fwd, bwd, comp, opt = fwd + c * f, bwd + c * (b + acc), comp + c * (m * (f + b + acc) + o), opt + c * o
        tf = kf = tb = kb = 0.0
        for _, d, steps in internal_steps(s, cl):
            t, k = problem.coster.time(steps), copy_seconds(steps, cm.memory_seconds)
            tf, kf, tb, kb = (tf + t, kf + k, tb, kb) if d == "fwd" else (tf, kf, tb + t, kb + k)
        # recomputed: the forward boxing again, and the local copies again (both passes', as ``Problem`` prices them)
        fwd, bwd = fwd + c * (tf + kf), bwd + c * (tb + kb + redo * (tf + kf + kb))
        comp, red = comp + c * m * (1 + redo) * (kf + kb), red + c * m * ((1 + redo) * tf + tb)
        tf = sum(problem.coster.step_time(st) for _, d, st in fsdp_steps(s, cl, mode) if d == "fwd")
        tb = sum(problem.coster.step_time(st) for _, d, st in fsdp_steps(s, cl, mode) if d != "fwd")
        xf, xb = max(0.0, tf - f), max(0.0, tb - b)
        fwd, bwd, red = fwd + c * xf, bwd + c * xb, red + c * m * (xf + xb)
    for (a, b), c in problem.edge_counts.items():
        sa, sb = problem.choices[a][assign[a]], problem.choices[b][assign[b]]
        (tf, kf), (tb, kb) = [(problem.coster.time(st), copy_seconds(st, cm.memory_seconds))
                              for st in edge_steps(sa, sb, problem.ops[a].out_shape, cl, problem.act_bytes)]
        again = factors.get((a, b), 1.0) - 1.0  # the forward boxing re-run in the backward pass
        fwd, bwd = fwd + c * (tf + kf), bwd + c * (again * (tf + kf) + tb + kb)
        comp, red = comp + c * m * ((1 + again) * kf + kb), red + c * m * ((1 + again) * tf + tb)
    sync = sum(float(c * problem.node_sync[v][i]) for v, (i, c) in enumerate(zip(assign, problem.counts))) \
        - problem.tied_saved(assign)
    return fwd, bwd, comp, red, sync, problem.exposed_sync(assign), opt
