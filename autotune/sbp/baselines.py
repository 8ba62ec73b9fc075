"""Baselines (AutoDDL §5): data parallelism, Megatron (tensor x data parallel,
best mesh), SUMMA 2D (best mesh). Each is a fixed assignment in a Problem.

Megatron on a (d, t) mesh: layer norms (S0: d, B: t); QKV, FC1 and logits
column-parallel (autoddl signature on (d, t, 1): output (S0, S1)); attention
(S0: d, S1(heads): t); the projection and FC2 row-parallel (transposed
signature on (d, t, 1): output (S0, P), all-reduced before the layer norm);
the embedding vocabulary-parallel ((d, 1, t): output partial over t); the
loss vocabulary-parallel after a column-parallel layer, else (after a
row-parallel one) on the all-reduced logits, computed redundantly over t. In a
plain chain of matmuls (MLP, VGG's dense layers) column- and row-parallel
alternate. Data parallelism is Megatron with t = 1.

The baselines users pick, each at its best recomputation (none, selective where
attention materialises its probabilities, full where the model has blocks: the
cheapest that fits, else the one needing least memory): data parallelism,
Megatron (best mesh), FSDP (data parallel over all devices, every weight sharded
over every axis: ZeRO-3), HSDP (data parallel, sharded over the intra-node axes,
replicated across nodes), TP+FSDP (torchtitan's 2-D: Megatron with t = the GPUs of
a node, sharded over the node axes), Megatron and TP+FSDP with sequence parallelism
(torchtitan's tensor parallelism, ``megatron_sp``; on a problem of every strategy,
``sequence_problem``); SUMMA and the S/B-only search without recomputation. The fit
check is the plans' own (``Problem.fits_plan``: at the peak, workspace included).
"""
from __future__ import annotations

import math

from calibrate.errors import UserError

from autotune.sbp.cost import Problem
from autotune.sbp.fit import recompute_modes
from autotune.sbp.layers import COLUMN_SP, UNIT_ROLE, Matmul, finish, fine_key
from autotune.sbp.memory import Mode, recipe_of
from autotune.sbp.mesh import RoleMesh, role_meshes
from autotune.sbp.techniques import context_role

ONE = (1, 1)


class _Index:
    """Find a layer's strategy by (signature, mesh), matching on what it does on the fine axes."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._by_key: dict[int, dict] = {}  # a matmul layer's strategies by fine key, made where one is looked up
        self.by_sig = [{(s.signature, s.mesh): i for i, s in enumerate(ss)} for ss in problem.choices]
        self._found: dict = {}

    def by_key(self, v: int) -> dict:
        if v not in self._by_key:
            self._by_key[v] = {fine_key(s, self.problem.cluster): i for i, s in enumerate(self.problem.choices[v])}
        return self._by_key[v]

    def get(self, v: int, key) -> int | None:
        op = self.problem.ops[v]
        if not isinstance(op, Matmul):
            return self.by_sig[v].get(key)
        if (v, key) not in self._found:
            try:
                s = finish(op.build(*key), self.problem.cluster)
            except UserError:
                s = None
            self._found[(v, key)] = None if s is None else self.by_key(v).get(fine_key(s, self.problem.cluster))
        return self._found[(v, key)]


def _index(problem: Problem) -> "_Index":
    """Built once per problem and shared with its modes and copies (``best_mesh`` asks for it once per mesh)."""
    return problem.shared("strategy index", lambda: _Index(problem))


def megatron_assignment(problem: Problem, d, t, row_first: bool = False,
                        sequence_parallel: bool = False, context=None) -> list[int] | None:
    """The Megatron plan on mesh (d, t), or None if some layer cannot take it. ``row_first``: the first matmul
    after a layer that is not one (VGG's fc0 after the convolutions) row-parallel, then alternating.
    ``sequence_parallel`` (Megatron-LM's ``--sequence-parallel``, Korthikanti et al. 2022): the layers between
    the tensor-parallel regions (norms, residual adds, dropout) on sequence shards, their tokens split over t
    as well as d (the one-role mesh of all d x t devices): their activations divided by t, and the boxing
    into and out of the tensor-parallel region an all-gather and a reduce-scatter over t where the plain plan
    has an all-reduce (the same bytes on a ring); under a Megatron-LM recipe (``Recipe.main_grad``: its own
    modules, not torch's ColwiseParallel, which keeps the gathered input) a column-parallel matmul after them
    keeps its input's sequence shard and gathers it again in the backward ("column-sp": the problem's strategies
    must hold it, ``autotune.pipeline.stage.Layout``). ``context`` (Megatron-LM's ``--context-parallel-size``, as d
    and t a size per tier): of the d data-parallel ranks, groups of ``context`` share each sequence; every layer
    but the attention core is placed as without it (tokens split over all d, weights replicated and their
    gradients synced over all d), the core runs context-parallel on (d / context, context, t) ("attention-cp":
    ``autotune.sbp.layers.Attention``)."""
    every = RoleMesh((tuple(a * b for a, b in zip(d, t)), ONE))
    idx = _index(problem)
    assign: list[int | None] = [None] * len(problem.ops)
    prev_split = False  # whether the previous layer's output is split over t along features
    prev_kind = None
    # Megatron's column-parallel layer after the sequence-parallel region keeps the shard
    shard = sequence_parallel and math.prod(t) > 1 and recipe_of(problem.recipe).main_grad
    prev_seq = False  # whether the previous layer is on sequence shards
    for v in problem.graph.chain:
        op = problem.ops[v]
        kind = op.layer.kind
        if row_first and kind == "matmul" and prev_kind in ("conv", "pool"):
            prev_split = True
        prev_kind = kind
        if kind == "embedding":
            key, split = ("autoddl", RoleMesh((d, ONE, t))), False
        elif kind == "matmul":
            column = COLUMN_SP if shard and prev_seq else "autoddl"
            key = ("transposed", RoleMesh((d, t, ONE))) if prev_split else (column, RoleMesh((d, t, ONE)))
            split = not prev_split
        elif kind in ("conv", "pool"):
            key, split = (kind, problem.choices[v][0].mesh), False
        elif kind == "loss":  # vocabulary-parallel after a column-parallel layer, else all-reduced and redundant
            sig = "loss" if prev_split or RoleMesh((d, t)).role_size(1) == 1 else "loss-replicated"
            key, split = (sig, RoleMesh((d, t))), False
        else:
            # the attention core and the activation (GELU, or SwiGLU on fc1's interleaved gate and up) keep the
            # features a column-parallel layer split over t: the next matmul runs row-parallel
            split = kind in ("attention", "pointwise", "swiglu")
            key = (kind, every if sequence_parallel and not split else RoleMesh((d, t)))
            if kind == "attention" and context is not None:
                key = ("attention-cp", RoleMesh((tuple(a // c for a, c in zip(d, context)), context, t)))
        i = idx.get(v, key) if kind != "residual" or sequence_parallel else whole_stream(problem, v, key[1])
        if i is None:
            return None
        if assign[v] is not None and assign[v] != i:
            return None
        assign[v] = i
        prev_split, prev_seq = split, key[1] == every and sequence_parallel
    return [int(a) for a in assign]


def megatron_sp(problem: Problem, d, t) -> list[int] | None:
    """The Megatron plan on (d, t) with sequence parallelism where apply runs it (the tensor or fully_shard path,
    torch's ``SequenceParallel``): t > 1, the micro-batch in whole sequences over d, each sequence split evenly
    over t, and t's fine axes after d's (t inside a node, or d across whole nodes); None elsewhere. ``problem``
    must hold the strategies that split tokens over t (``sequence_problem``)."""
    d_size, t_size = math.prod(d), math.prod(t)
    seq = problem.graph.config.get("sequence")
    if t_size == 1 or seq is None or problem.graph.micro_batch % d_size or seq % t_size or (t[0] > 1 and d[1] > 1):
        return None
    return megatron_assignment(problem, d, t, sequence_parallel=True)


def megatron_cp(problem: Problem, d, t, c: int) -> list[int] | None:
    """The Megatron plan on (d, t) with context parallelism over ``c`` of the d ranks, the innermost
    (``context_role``); None where ``c`` does not divide them so or a layer cannot take it. ``problem``: the
    graph's ``context_parallel(graph, c)``, every strategy (``context_problem``)."""
    inside = context_role(d, c)
    return None if inside is None else megatron_assignment(problem, d, t, context=inside)


def context_problem(graph, coster, memory_limit, objective: str) -> Problem:
    """The problem the context-parallel baselines (``megatron_cp``) are placed on: ``graph`` offering context
    parallelism (``autotune.sbp.techniques.context_parallel``), every strategy (their layers split each sequence
    over the group, which ``Problem``'s runnable rows leave out)."""
    return Problem(graph, coster, memory_limit, require_fit=False, objective=objective, runnable=False)


def sequence_problem(graph, coster, memory_limit, objective: str) -> Problem:
    """The problem the sequence-parallel baselines (``megatron_sp``) are placed on: every strategy (their
    norms split tokens over t, which ``Problem``'s runnable rows leave out where the micro-batch has fewer
    sequences than devices), a matmul's only on Megatron's meshes (``UNIT_ROLE``)."""
    return Problem(graph, coster, memory_limit, signatures=(UNIT_ROLE,), require_fit=False, objective=objective,
                   runnable=False)


def whole_stream(problem: Problem, v: int, mesh: RoleMesh) -> int | None:
    """The residual add's strategy on ``mesh`` with the stream whole on role 1 (Megatron-LM's: each
    tensor-parallel rank adds the whole stream, the row-parallel layers' partial sums all-reduced into it)."""
    whole = ("S0", "S1") if mesh.role_size(1) == 1 else ("S0", "B")  # on a role of one device, the same strategy
    return next((i for i, s in enumerate(problem.choices[v]) if s.mesh == mesh and s.input.sbp == whole), None)


def summa_assignment(problem: Problem, r, c, signature: str = "summa") -> list[int] | None:
    """SUMMA on an r x c mesh; ``signature`` "summa" (panels kept) or "summa-lean" (broadcast again)."""
    idx = _index(problem)
    out = []
    for v, op in enumerate(problem.ops):
        kind = op.layer.kind
        if kind in ("matmul", "embedding"):
            key = (signature, RoleMesh((r, c)))
        elif kind in ("conv", "pool"):
            key = (kind, problem.choices[v][0].mesh)
        else:
            key = (kind, RoleMesh((r, c)))
        i = idx.get(v, key)
        if i is None:
            return None
        out.append(i)
    return out


def best_mesh(problem: Problem, make, fits=None) -> tuple[list[int] | None, float, tuple | None]:
    """The cheapest plan ``make(problem, a, b)`` over all 2-role meshes (a, b) that fits the memory limit
    (``fits(plan)``, default ``problem.fits_plan``); if none fits, the one that needs the least memory (its
    cost inf)."""
    fits = fits or problem.fits_plan
    best, best_cost, best_mesh_ = None, math.inf, None
    least, least_mem, least_mesh = None, math.inf, None
    for m in role_meshes(problem.cluster, 2):
        a = make(problem, *m.sizes)
        if a is None:
            continue
        problem.evaluations += 1
        mem = problem.peak_memory(a) if problem.recipe != "autoddl" else problem.memory_of(a)
        cost = problem.raw_cost(a) if fits(a) else math.inf
        if cost < best_cost:
            best, best_cost, best_mesh_ = a, cost, m.sizes
        if mem < least_mem:
            least, least_mem, least_mesh = a, mem, m.sizes
    if best is None:
        return least, math.inf, least_mesh
    return best, best_cost, best_mesh_


def at_best_recompute(problem: Problem, make, fsdp_axes: tuple[int, ...] | None = None):
    """``make(problem)`` -> (plan or None, detail) under each recomputation (and FSDP over ``fsdp_axes``):
    (problem of the mode, plan, detail) of the cheapest that fits, else of the one needing least memory;
    None if no mode has a plan."""
    best = least = None
    for rec in ["none"] + recompute_modes(problem):
        mode = Mode(rec, fsdp_axes)
        pr = problem if mode == problem.mode else problem.with_mode(mode)
        a, detail = make(pr)
        if a is None:
            continue
        mem = pr.peak_memory(a)
        if pr.device_limit is None or mem <= pr.device_limit:
            cost = pr.raw_cost(a)
            if best is None or cost < best[0]:
                best = (cost, pr, a, detail)
        if least is None or mem < least[0]:
            least = (mem, pr, a, detail)
    pick = best or least
    return None if pick is None else pick[1:]


def data_parallel(problem: Problem) -> list[int] | None:
    cl = problem.cluster
    return megatron_assignment(problem, (cl.nodes, cl.gpus_per_node), ONE)


def _name(pr: Problem, name: str) -> str:
    rec = pr.mode.recompute
    return name if rec == "none" else f"{name}, recompute {rec}"


def baseline_plans(problem: Problem, summa: Problem | None, sb: Problem | None, search_sb,
                   skipped: list | None = None, sequence: Problem | None = None,
                   context: dict | None = None) -> list[tuple]:
    """(problem, assignment, name, search) of each baseline plan: data parallelism, the best Megatron mesh, FSDP,
    HSDP and TP+FSDP, each at its best recomputation (``at_best_recompute``), with ``sequence`` (a
    ``sequence_problem``) the best Megatron mesh and TP+FSDP with sequence parallelism too, the best SUMMA mesh
    (``summa``: the problem restricted to SUMMA's signature) and
    the search restricted to S and B (``sb``, searched by ``search_sb(problem)``). A baseline with no plan
    under the memory limit is still a plan, the one needing the least memory, and ``autotune.plan.build`` says
    so (``costs.fits_memory`` false, on the path the plan runs by): it never aborts the run. A baseline no plan
    of which exists (some layer cannot take its placement: e.g. data parallelism with fewer sequences in a
    micro-batch than devices) is named in ``skipped``. The
    sequence-parallel ones say so in their search record (``{"sequence_parallel": true}``): apply runs such a
    plan where its layout is one of torch's styles (``autotune.plan.layouts.sequence_axes``), which the caller
    checks on the typed plan. ``context``: size c -> its ``context_problem``, the best Megatron mesh and FSDP
    with context parallelism over c (``megatron_cp``; ``{"context_parallel": c}``) for each."""
    cl = problem.cluster
    nodes, gpus = (cl.nodes, 1), (1, cl.gpus_per_node)
    node_axes = tuple(range(len(cl.node_axes)))
    gpu_axes = tuple(range(len(cl.node_axes), len(cl.axis_sizes)))
    every = node_axes + gpu_axes

    def megatron(make):
        def best(pr):
            a, _, mesh = best_mesh(pr, make)
            return a, (f"d={tuple(mesh[0])}, t={tuple(mesh[1])}" if mesh else "")
        return best

    # (name, make, FSDP axes, the problem it is placed on, its search record)
    rows = [("data parallel", lambda pr: (data_parallel(pr), ""), None, problem, None),
            ("Megatron", megatron(megatron_assignment), None, problem, None),
            ("FSDP", lambda pr: (data_parallel(pr), "d = all devices, sharded over every axis"), every, problem, None),
            ("HSDP", lambda pr: (data_parallel(pr), "sharded inside each node, replicated across nodes"), gpu_axes,
             problem, None),
            ("TP+FSDP", lambda pr: (megatron_assignment(pr, nodes, gpus), f"t={gpus}, sharded over the node axes"),
             node_axes, problem, None)]
    if sequence is not None:
        sp = {"sequence_parallel": True}
        rows += [("Megatron, sequence parallel", megatron(megatron_sp), None, sequence, sp),
                 ("TP+FSDP, sequence parallel", lambda pr: (megatron_sp(pr, nodes, gpus),
                                                            f"t={gpus}, sharded over the node axes"),
                  node_axes, sequence, sp)]
    for c, pr in (context or {}).items():  # torchtitan's FSDP + CP beside Megatron-LM's
        cp = {"context_parallel": c}
        rows += [(f"Megatron, context parallel {c}", megatron(lambda p, d, t, c=c: megatron_cp(p, d, t, c)), None, pr,
                  cp),
                 (f"FSDP, context parallel {c}", lambda p, c=c: (megatron_cp(p, (cl.nodes, cl.gpus_per_node), ONE, c),
                                                                "d = all devices, sharded over every axis"), every, pr,
                  cp)]
    out = []
    for name, make, axes, base, record in rows:
        if axes is not None and not axes:
            continue  # no axis to shard over: the same plan as without FSDP
        found = at_best_recompute(base, make, axes)
        if found is None:
            if skipped is not None:
                skipped.append(name)
            continue
        pr, a, detail = found
        out.append((pr, a, _name(pr, f"{name} ({detail})" if detail else name), dict(record) if record else None))
    if summa is not None:
        a, _, mesh = best_mesh(summa, summa_assignment)
        if a is not None:
            out.append((summa, a, f"SUMMA 2D ({tuple(mesh[0])} x {tuple(mesh[1])})", None))
    if sb is not None:
        if sb.fits:
            res = search_sb(sb)
            out.append((sb, res.assignment, f"S/B only ({res.algorithm})",
                        {"algorithm": res.algorithm, "seconds": res.seconds, "stopped": res.stopped}))
        else:
            out.append((sb, sb.min_memory_assignment(), "S/B only", None))
    return out
