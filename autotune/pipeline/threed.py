"""The Megatron-style 3-D baseline, as users of Megatron-LM run it: tensor parallelism t inside a node,
pipeline stages of whole nodes, data parallelism over the rest, and the training modes that make large
models fit.

Degrees: p stages of whole nodes (p divides the node count, p <= blocks; the given count if the search has
one), the Megatron plan inside each stage on its mesh (d, t) with t in the divisors of the GPUs per node and
d = the stage's devices / t (``autotune.sbp.baselines.megatron_assignment``: column- then row-parallel
matmuls, vocabulary-parallel logits; data parallelism over whole sequences, so a micro-batch must hold a
multiple of d sequences), the balanced split of the blocks, and m micro-batches (every divisor of the batch
up to 8p, fewer than p too: Megatron's ``--global-batch-size`` / (``--micro-batch-size`` x d), which its 1F1B
runs with a larger bubble, ``micro_batch_counts``).

Modes, one for every stage as Megatron's flags set them: activation recomputation none, selective (the
attention's probabilities) or full (a block keeps its input; ``--recompute-granularity``), each without and
with the weights, gradients and optimizer states sharded over the data-parallel group (Megatron-FSDP's
``optim_grads_params``, ZeRO-3: ``autotune.sbp.memory.Mode`` with every axis as FSDP's, which shards each
weight over its gradient-sync axes, the data-parallel ones). Megatron's distributed optimizer (ZeRO-1:
optimizer states alone sharded over the data-parallel group, ``--use-distributed-optimizer``;
``autotune.sbp.memory.Mode.zero``), and ZeRO-2 (gradients too: Llama 3's), are offered beside them (their
reduce-scatter and all-gather priced as the all-reduce whose bytes they move). A mode is tried for a
(p, t, m) only where no plain plan fits: the plain plan is the cheapest that fits when one does.

Every (p, t, m) whose stages all fit (at its cheapest mode by the split DP's estimate,
``autotune.pipeline.split``) is simulated with its boundaries (``PipelineSearch.finish``) and the fastest
step is the baseline. Not ranked by the estimate: it leaves the boundaries out, which with many stages and few
micro-batches sit on the critical path (GPT-3 175B on 2,048 x 8: the best estimate, 64 stages of 48
micro-batches, simulates to 4.08 s; the fourth, 32 stages of 24, to 3.51 s); but a candidate whose step's lower
bound (``Candidate.floor``) is no better than the fastest simulated step is not simulated (``finished``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

from calibrate.errors import UserError

from autotune.pipeline.paths import stage_path
from autotune.pipeline.search import Candidate, PipelineSearch, StagePlan, fewer_collections, stage_choices
from autotune.pipeline.slicing import stage_spans
from autotune.pipeline.stage import figures
from autotune.plan.layouts import CONTEXT_STAGE_PATHS
from autotune.plan.typed import ApplyPath
from autotune.sbp.fit import least_count, recompute_modes
from autotune.sbp.memory import NONE, Mode
from autotune.sbp.mesh import Cluster, role_meshes
from autotune.sbp.techniques import context_parallel_of, context_role

LOCAL_ZERO = (ApplyPath.DDP.value, ApplyPath.TENSOR.value)  # the stage paths apply runs ZeRO and SP on


def modes(search: PipelineSearch, m: int, span, sub: Cluster, sharding: bool = True) -> list[Mode]:
    """The modes after the plain one: each recomputation the model has, without and (``sharding``) with FSDP
    over the data-parallel group."""
    plain = search.stages.layout(m, span, sub, megatron=True)
    every = tuple(range(len(sub.axis_sizes)))
    # (FSDP axes, ZeRO stage): none; ZeRO-1, Megatron-LM's --use-distributed-optimizer; ZeRO-2, gradients too
    # (Llama 3's); FSDP (ZeRO-3)
    shardings = ((None, 0), (None, 1), (None, 2), (every, 0)) if sharding else ((None, 0),)
    return [Mode(rec, sh, z) for rec in ["none"] + recompute_modes(plain) for sh, z in shardings
            if Mode(rec, sh, z) != NONE]


def describe(mode: Mode) -> str:
    blocks = f" (each stage's first {mode.blocks} blocks)" if mode.blocks else ""
    parts = [] if mode.recompute == "none" else [f"recompute {mode.recompute}{blocks}"]
    parts += [f"ZeRO-{mode.zero} (distributed optimizer)"] if mode.zero else []
    return ", ".join(parts + ([] if mode.fsdp_axes is None else ["FSDP over the data-parallel group"]))


def stage_plans(search: PipelineSearch, p: int, sub: Cluster, m: int, mesh: tuple,
                mode: Mode, sequence_parallel: bool = False) -> list[StagePlan] | None:
    """The Megatron plan of every stage on ``mesh`` under ``mode`` (with ``sequence_parallel``: Megatron-LM's
    ``--sequence-parallel``), None where a layer cannot take it (each on a problem that prices Megatron's
    strategies alone: ``StageSearch.megatron``)."""
    spans = stage_spans(search.graph_for(m), search.balanced(p))
    out = []
    for i, span in enumerate(spans):
        found = search.stages.megatron(m, span, sub, search.inflight(i, p, m), mesh, mode, sequence_parallel)
        if found is None:
            return None
        prob, a = found
        out.append(StagePlan(prob, a, figures(prob, a), {"algorithm": "megatron", "recompute": mode.recompute,
                                                         **({"recompute_blocks": mode.blocks} if mode.blocks else {}),
                                                         "sharding": mode.sharding,
                                                         "sequence_parallel": sequence_parallel}))
    return out


def fewer_blocks(search: PipelineSearch, best: Candidate, mesh: tuple) -> Candidate:
    """A 3-D candidate under full recomputation (no FSDP) with Megatron-LM's block method instead: each stage
    re-running its first N blocks, the fewest N (one for every stage, as ``--recompute-num-layers``) under which
    every stage fits (a binary search: memory falls as N grows); ``best`` where none fewer than all fits."""
    mode = best.plans[0].problem.mode
    n = min(len(getattr(x.problem.graph, "blocks", None) or []) for x in best.plans)
    if not mode.takes_blocks or n < 2:
        return best
    sp = bool(best.plans[0].search.get("sequence_parallel"))

    @functools.cache
    def made(b: int) -> Candidate | None:
        plans = stage_plans(search, best.stages, best.sub, best.micro_batches, mesh, replace(mode, blocks=b), sp)
        c = None if plans is None else search.candidate(best.stages, best.sub, best.micro_batches,
                                                        search.balanced(best.stages), plans)
        return c if c is not None and math.isfinite(c.estimate) else None
    b = least_count(n - 1, lambda b: made(b) is not None)
    return made(b) if b else best


def micro_batch_counts(batch: int, stages: int, sub: Cluster, tensor_in_node: bool,
                       most: int | None = None, context: int = 1) -> list[int]:
    """Micro-batch counts m dividing the batch, at most ``most`` (default 8p, as the stage search); fewer than p
    too (Megatron's 1F1B then runs min(p - i, m) forwards before the first backward, with a bubble of
    (p - 1) / m: the only counts whose micro-batch splits over the data-parallel group where that group is
    large); with t inside a node, only those whose micro-batch splits over the stage's nodes (d is at least the
    node count), or over the nodes a ``context``-parallel group leaves whole sequences on (at least the node
    count over ``context``)."""
    whole = max(1, sub.nodes // context)
    return [m for m in range(1, (most or 8 * stages) + 1) if batch % m == 0
            and (not tensor_in_node or (batch // m) % whole == 0)]


def candidates(search: PipelineSearch, tensor_in_node: bool = True, sharding: bool = True,
               most: int | None = None) -> list[Candidate]:
    """Every (p, t, m) at its cheapest mode whose stages all fit; ``tensor_in_node`` False lets t span nodes
    (clusters of one GPU a node, as AutoDDL's Megatron on Piz Daint); ``sharding`` False leaves FSDP out (the
    Megatron-LM of 2021, AutoDDL's baseline); ``most``: the most micro-batches (``micro_batch_counts``)."""
    out = []
    cp = context_parallel_of(search.graph)
    for p, sub in stage_choices(search.graph, search.cluster, search.cfg.stages):
        if sub.gpus_per_node != search.cluster.gpus_per_node:
            continue  # Megatron's stages are whole nodes, t inside one
        meshes = [r.sizes for r in role_meshes(sub, 2) if r.sizes[1][0] == 1 or not tensor_in_node]
        if cp > 1:  # the context-parallel groups inside the data-parallel ranks, a node's GPUs first (Megatron's)
            meshes = [mesh + (context_role(mesh[0], cp),) for mesh in meshes if context_role(mesh[0], cp)]
        for m in micro_batch_counts(search.graph.batch, p, sub, tensor_in_node, most, cp):
            if not search.runs(p, m):
                continue
            for mesh in meshes:
                try:
                    plain = stage_plans(search, p, sub, m, mesh, NONE)
                except UserError:  # a stage with no strategy on its submesh at this micro-batch
                    break
                if plain is None:
                    continue  # the micro-batch's sequences do not split over d
                t = math.prod(mesh[1])
                found = [search.candidate(p, sub, m, search.balanced(p), plain)]
                # where the plain plan does not fit: Megatron's --sequence-parallel with t > 1 (where the plan
                # that sharding allows takes it: never more memory, the all-reduce's bytes), then the modes
                sp = sharding and t > 1 and not math.isfinite(found[0].estimate)
                if sp:
                    plans = stage_plans(search, p, sub, m, mesh, NONE, True)
                    if plans is not None:
                        found.append(search.candidate(p, sub, m, search.balanced(p), plans))
                if not math.isfinite(min(c.estimate for c in found)):
                    span = stage_spans(search.graph_for(m), search.balanced(p))[0]
                    for mode in modes(search, m, span, sub, sharding):
                        plans = stage_plans(search, p, sub, m, mesh, mode, sp)
                        if plans is not None:
                            found.append(search.candidate(p, sub, m, search.balanced(p), plans))
                # each fully recomputed candidate re-running only the blocks it needs: one may now beat the others
                best = min((fewer_blocks(search, c, mesh) for c in found), key=lambda c: c.estimate)
                if math.isfinite(best.estimate):
                    mode = best.plans[0].problem.mode
                    parallel = best.plans[0].search.get("sequence_parallel")
                    extra = (f", {describe(mode)}" if mode != NONE else "") + (", sequence parallel" if parallel else "")
                    best.name = f"Megatron 3-D (t={t}, {p} stages, {m} micro-batches{extra})"
                    best.tensor = t
                    out.append(best)
    return out


def finished(search: PipelineSearch, tensor_in_node: bool = True, sharding: bool = True,
             most: int | None = None) -> list[Candidate]:
    """The candidates that fit and can be the fastest, simulated, fastest first: candidates are simulated in the
    order of their step's lower bound (``Candidate.floor``), and one whose bound is no better than the fastest
    step so far is left out (it cannot be the baseline)."""
    out: list[Candidate] = []
    best = math.inf
    with fewer_collections():
        found = candidates(search, tensor_in_node, sharding, most)
    for c in sorted(found, key=lambda c: c.floor):
        if c.floor >= best:
            break
        c = search.finish(c)
        if math.isfinite(c.step):
            out.append(c)
            best = min(best, c.step)
    return sorted(out, key=lambda c: c.step)


def megatron_3d(search: PipelineSearch, tensor_in_node: bool = True, sharding: bool = True,
                most: int | None = None) -> Candidate | None:
    """The best Megatron-style 3-D plan that fits (every candidate simulated), None if none does."""
    return next(iter(finished(search, tensor_in_node, sharding, most)), None)


def seeded(search: PipelineSearch, tensor_in_node: bool = True, sharding: bool = True,
           most: int | None = None, runnable: bool = False) -> tuple[Candidate | None, Candidate | None, bool]:
    """(the pipelined plan, the 3-D baseline, whether the plan is a 3-D one): the stage search's best, seeded
    with the 3-D plans at the candidate level (a 3-D plan is one of the search's plans: the same stages, splits
    and per-stage SBP placements): the fastest 3-D plan where it is faster, fewer micro-batches than stages
    included (``autotune.apply_pipeline`` runs them in the order the step model prices, Megatron's 1F1B among
    them). So the pipelined plan is never slower than the 3-D baseline, or, with ``runnable`` (a plan users
    apply), than the fastest 3-D plan ``applies`` (the baseline may then be one apply does not run: it is
    Megatron-LM's, exported to it)."""
    best, done = search.run(), finished(search, tensor_in_node, sharding, most)
    mega = next(iter(done), None)
    seed = next((c for c in done if not runnable or applies(c)), None)
    if seed is not None and (best is None or seed.step < best.step):
        return seed, mega, True
    return best, mega, False


def applies(c: Candidate) -> bool:
    """Whether ``autotune.apply_pipeline`` runs a 3-D plan as priced: context parallelism only without tensor
    parallelism, on stages apply places by DDP or fully_shard (``CONTEXT_STAGE_PATHS``: each rank's chunks crossing
    the boundaries), ZeRO (Megatron-LM's distributed optimizer) and sequence parallelism only on stages apply places
    by DDP or the tensor path (ZeRO run on fully_shard, the sequence shards crossing the boundaries); any chunks a
    rank (interleaved 1F1B) that each hold a block."""
    def path(x) -> str:
        return x.fig.path or stage_path(x.problem, x.assign)
    return all(k >= c.virtual for k in c.split) and all(
        (context_parallel_of(x.problem.graph) == 1 or c.tensor == 1 and path(x) in CONTEXT_STAGE_PATHS)
        and (x.problem.mode.zero == 0 and not x.search.get("sequence_parallel") or path(x) in LOCAL_ZERO)
        for x in c.plans)
