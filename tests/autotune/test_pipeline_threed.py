"""The Megatron-style 3-D baseline (``autotune.pipeline.threed``) on a small GPT: its degrees, the best
simulated step among them, and recomputation / FSDP where no plain plan fits."""
import math

import pytest

from autotune.pipeline.search import PipelineConfig, PipelineSearch
from autotune.pipeline.threed import candidates, finished, megatron_3d, seeded, stage_plans
from autotune.sbp.memory import NONE, Mode
from autotune.sbp.mesh import Cluster, role_meshes

CLUSTER = Cluster(4, 2)



def test_degrees_and_the_best_simulated_step(graph, profile):
    ps = PipelineSearch(graph, CLUSTER, profile, 80 * 2**30, PipelineConfig(refine=1000))
    cs = candidates(ps)
    # whole-node stages (2 or 4 of 2 nodes or 1), t in {1, 2} inside a node, m from p to 8p dividing 16
    assert {c.stages for c in cs} == {2, 4} and {c.tensor for c in cs} == {1, 2}
    assert all(c.sub.gpus_per_node == 2 and c.micro_batches <= 8 * c.stages and 16 % c.micro_batches == 0 for c in cs)
    assert any(c.micro_batches < c.stages for c in cs)  # Megatron runs fewer micro-batches than stages too
    assert all(x.problem.mode == NONE for c in cs for x in c.plans)  # 80 GiB: every plain plan fits
    best = megatron_3d(ps)
    steps = [ps.finish(c).step for c in cs]
    assert best.step == pytest.approx(min(steps))
    assert best.name.startswith(f"Megatron 3-D (t={best.tensor}, {best.stages} stages, {best.micro_batches} ")


def test_recomputation_or_fsdp_where_no_plain_plan_fits(graph, profile):
    ps = PipelineSearch(graph, CLUSTER, profile, 80 * 2**30, PipelineConfig())
    # the least memory any plain 3-D plan needs at its busiest stage; a limit just below it
    least = min(max(x.fig.memory for x in c.plans) for c in candidates(ps))
    limit = least * (1 - 1e-6)
    tight = PipelineSearch(graph, CLUSTER, profile, limit, PipelineConfig())
    best = megatron_3d(tight)
    assert best is not None and math.isfinite(best.step)
    mode = best.plans[0].problem.mode
    assert mode != NONE and all(x.problem.mode == mode for x in best.plans)  # one mode for every stage, as flags
    assert all(x.fig.fits and x.fig.memory <= limit for x in best.plans)
    assert ("recompute" in best.name) == (mode.recompute != "none") and ("FSDP" in best.name) == \
        (mode.fsdp_axes is not None)
    # no plain plan of those degrees fits the limit
    mesh = next(r.sizes for r in role_meshes(best.sub, 2) if r.sizes[1] == (1, best.tensor))
    plain = stage_plans(tight, best.stages, best.sub, best.micro_batches, mesh, NONE)
    assert not all(x.fig.fits for x in plain)
    # and the mode costs time: the plain plan of the same degrees (unlimited) is faster per micro-batch
    free = stage_plans(ps, best.stages, best.sub, best.micro_batches, mesh, NONE)
    assert sum(x.fig.forward + x.fig.backward for x in free) < sum(x.fig.forward + x.fig.backward for x in best.plans)


@pytest.mark.parametrize("stages", [2, 4])
def test_the_seeded_search_is_never_slower_than_the_3d_baseline(graph, profile, stages):
    ps = PipelineSearch(graph, CLUSTER, profile, 80 * 2**30, PipelineConfig(stages=stages))
    best, mega, same = seeded(ps)
    fresh = PipelineSearch(graph, CLUSTER, profile, 80 * 2**30, PipelineConfig(stages=stages))
    alone, done = fresh.run(), finished(fresh)
    assert mega.step == pytest.approx(done[0].step)  # the baseline: the fastest, whatever its micro-batches
    assert best.step == pytest.approx(min(alone.step, mega.step)) and same == (mega.step < alone.step)


def test_fewer_micro_batches_than_stages_priced_as_megatron_runs_them(graph, profile):
    # 4 stages: stage i keeps min(p - i, m) in flight and runs that many forwards before its first backward
    ps = PipelineSearch(graph, CLUSTER, profile, 80 * 2**30, PipelineConfig(stages=4))
    few = [ps.finish(c) for c in candidates(ps) if c.micro_batches < c.stages]
    assert few
    for c in few:
        m, p = c.micro_batches, c.stages
        assert [x.problem.inflight for x in c.plans] == [min(p - i, m) for i in range(p)]
        for i in range(p):
            kinds = [iv.kind for iv in sorted(c.result.intervals, key=lambda iv: iv.start)
                     if iv.lane == f"stage {i}" and iv.kind in ("F", "B")]
            w = min(p - i, m)
            assert kinds == ["F"] * w + ["B", "F"] * (m - w) + ["B"] * w


def _full_problem_plans(ps, p, sub, m, mesh, mode):
    """The 3-D stage plans as they were made before ``StageSearch.megatron``: on the full stage problem (every
    strategy of every layer priced), Megatron's plan picked from it."""
    from autotune.pipeline.search import StagePlan, inflight
    from autotune.pipeline.slicing import stage_spans
    from autotune.pipeline.stage import figures
    from autotune.sbp.baselines import megatron_assignment
    out = []
    for i, span in enumerate(stage_spans(ps.graph_for(m), ps.balanced(p))):
        prob = ps.stages.problem(m, span, sub, inflight(ps.schedule, i, p, m), mode)
        a = megatron_assignment(prob, *mesh)
        if a is None:
            return None
        out.append(StagePlan(prob, a, figures(prob, a), {}))
    return out


@pytest.mark.parametrize("stages,tensor,m,recompute,fsdp", [
    (2, 2, 4, "none", False), (2, 1, 2, "none", False), (4, 2, 2, "none", False), (4, 2, 8, "full", False),
    (2, 2, 4, "selective", True), (4, 1, 8, "full", True), (2, 1, 8, "none", False)])
def test_megatron_only_stage_problems_give_the_full_problems_figures(graph, profile, stages, tensor, m, recompute,
                                                                     fsdp):
    """The 3-D baseline prices Megatron's strategies alone (``StageSearch.megatron``): per stage the same
    forward, backward, sync, optimizer and peak memory as on the full stage problem, and the same simulated step
    (its boundaries read the plans' strategies); under a limit that some stages miss, the same fit verdicts."""
    sub = Cluster(CLUSTER.nodes // stages, CLUSTER.gpus_per_node)
    mode = Mode(recompute, tuple(range(len(sub.axis_sizes))) if fsdp else None)  # FSDP over the data-parallel group
    mesh = next(r.sizes for r in role_meshes(sub, 2) if r.sizes[1] == (1, tensor))
    for limit in (80 * 2**30, None):
        ps = PipelineSearch(graph, CLUSTER, profile, limit or 80 * 2**30, PipelineConfig())
        before = _full_problem_plans(ps, stages, sub, m, mesh, mode)
        if before is None:  # 2 sequences a micro-batch do not split over d = 4: neither way has a plan
            assert stage_plans(ps, stages, sub, m, mesh, mode) is None
            return
        if limit is None:  # a limit between the stages' peaks: the first stages (more in flight) miss it
            peaks = sorted(x.fig.memory for x in before)
            limit = (peaks[0] + peaks[-1]) / 2
            ps = PipelineSearch(graph, CLUSTER, profile, limit, PipelineConfig())
            before = _full_problem_plans(ps, stages, sub, m, mesh, mode)
            assert {x.fig.fits for x in before} == {True, False}
        after = stage_plans(ps, stages, sub, m, mesh, mode)
        assert all(len(c) == 1 for x in after for c in x.problem.choices)  # one strategy a layer priced
        assert any(len(c) > 1 for x in before for c in x.problem.choices)
        for x, y in zip(before, after):
            assert x.fig == y.fig
            assert [x.problem.choices[v][i] for v, i in enumerate(x.assign)] == \
                [y.problem.choices[v][i] for v, i in enumerate(y.assign)]
            assert x.problem.exposed_sync(x.assign) == y.problem.exposed_sync(y.assign)
        c0 = ps.finish(ps.candidate(stages, sub, m, ps.balanced(stages), before))
        c1 = ps.finish(ps.candidate(stages, sub, m, ps.balanced(stages), after))
        assert c0.step == c1.step and c0.boundaries == c1.boundaries and c0.estimate == c1.estimate


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "eager-1f1b"])
def test_simulation_skipped_only_where_the_floor_cannot_win(graph, profile, schedule):
    """``Candidate.floor`` is under every candidate's simulated step (a lower bound under each schedule), and
    ``finished`` (which simulates only candidates whose floor beats the fastest so far) gives the fastest plan
    that simulating every candidate gives."""
    ps = PipelineSearch(graph, CLUSTER, profile, 80 * 2**30, PipelineConfig(schedule=schedule))
    every = [ps.finish(c) for c in candidates(ps)]
    assert len(every) > 10 and all(c.floor <= c.step * (1 + 1e-12) for c in every)
    assert any(c.floor > c.estimate for c in every)  # tighter than the estimate somewhere
    done = finished(PipelineSearch(graph, CLUSTER, profile, 80 * 2**30, PipelineConfig(schedule=schedule)))
    assert done[0].step == min(c.step for c in every)
    assert [c.step for c in done] == sorted(c.step for c in done) and len(done) < len(every)


def test_pipelined_plans_memory_line_is_the_binding_stages(graph, profile):
    """Issue 43: the printed memory of a pipelined plan is the stage that binds (the most memory), its parts
    adding up to its total, and the recompute / sharding line names each stage's mode."""
    from autotune.pipeline.record import pipeline_plan
    from autotune.cli.search import breakdown, modes_line
    ps = PipelineSearch(graph, CLUSTER, profile, 80 * 2**30, PipelineConfig(stages=4))
    c = ps.finish(megatron_3d(ps))
    plan = pipeline_plan(ps, c, "test", {})
    t = plan.costs
    i = t.memory_stage
    assert t.memory_bytes == max(s.memory_bytes for s in plan.stages) == plan.stages[i].memory_bytes
    parts = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "workspace_bytes")
    assert sum(t.memory[k] for k in parts) == pytest.approx(t.memory_bytes, rel=1e-6)
    assert f"binding stage ({i} of 4" in breakdown(plan)
    from dataclasses import replace
    plan = replace(plan, stages=tuple(replace(s, plan=replace(s.plan, recompute="full" if k < 3 else "none",
                                                              sharding_mode="none", sharding_axes=()))
                                      for k, s in enumerate(plan.stages)))
    assert modes_line(plan) == ("stages 0-2 (3 of 4): recompute full; sharding none; "
                                "stages 3 (1 of 4): recompute none; sharding none")
    # a workspace below zero (the peak before every gradient exists) is said to be so
    assert "below zero" not in breakdown(plan)
    low = replace(t, memory={**t.memory, "workspace_bytes": -2**31})
    assert "workspace -2.00 GiB (below zero: not every gradient exists yet at the peak)" in \
        breakdown(replace(plan, costs=low))


def test_sequence_parallel_shards_the_norms_and_swaps_all_reduce_for_gather_scatter(graph, profile):
    """Megatron's --sequence-parallel (issue 43): the norms and residual adds hold 1/t of their activations;
    the boxing into and out of each tensor-parallel region moves the all-reduce's bytes as an all-gather plus a
    reduce-scatter (on a ring: (t-1)/t n beta each, the all-reduce's 2 (t-1)/t n beta)."""
    from autotune.plan.build import build as build_plan
    ps = PipelineSearch(graph, CLUSTER, profile, None, PipelineConfig(stages=2))
    sub = Cluster(2, 2)
    t, mesh = 2, ((2, 1), (1, 2))
    plain, sp = (stage_plans(ps, 2, sub, 4, mesh, NONE, s)[1] for s in (False, True))

    def by_kind(x, key):
        out = {}
        for lay in build_plan(x.problem, x.assign, "x").layers:
            out[lay.kind] = out.get(lay.kind, 0.0) + lay.costs[key] * lay.count
        return out
    mp, ms = by_kind(plain, "memory_bytes"), by_kind(sp, "memory_bytes")
    if "residual" in mp:
        assert ms["residual"] == pytest.approx(mp["residual"] / t, rel=1e-6)  # no weights: activations alone
    assert mp["layernorm"] / t < ms["layernorm"] < mp["layernorm"]  # its (replicated) weights kept whole
    assert ms["matmul"] == pytest.approx(mp["matmul"], rel=1e-6)
    rp, rs = by_kind(plain, "redistribution_s"), by_kind(sp, "redistribution_s")
    assert sum(rs.values()) == pytest.approx(sum(rp.values()), rel=0.05)  # the same bytes, twice the alphas
    assert sp.fig.memory < plain.fig.memory


def test_sequence_parallel_is_tried_where_the_plain_plan_does_not_fit(graph, profile):
    """Where no plain 3-D plan fits, the baseline tries Megatron's --sequence-parallel (t > 1) before the modes,
    and keeps it with them; never with sharding off (the Megatron of 2021)."""
    ps = PipelineSearch(graph, CLUSTER, profile, 80 * 2**30, PipelineConfig())
    least = min(max(x.fig.memory for x in c.plans) for c in candidates(ps) if c.tensor > 1)
    tight = PipelineSearch(graph, CLUSTER, profile, least * (1 - 1e-6), PipelineConfig())
    got = [c for c in candidates(tight) if c.tensor > 1]
    assert got and all(c.plans[0].search.get("sequence_parallel") for c in got)
    assert all("sequence parallel" in c.name for c in got)
    assert not any(c.plans[0].search.get("sequence_parallel") for c in candidates(tight, sharding=False))


def test_a_plan_users_apply_is_never_a_3d_plan_apply_does_not_run():
    """``seeded(runnable=True)`` (the main command's): the fastest 3-D plan that ``apply_pipeline`` runs is the
    seed, not a faster one with sequence parallelism or ZeRO on a stage of the DTensor path, or with a chunk
    without a block (priced, not run); either on the tensor path, and chunks a rank of a block or more (interleaved
    1F1B), it runs. The baseline stays the fastest 3-D
    plan of all. Without ``runnable`` (the published runs) the fastest is the seed."""
    from types import SimpleNamespace as NS
    from unittest import mock
    import autotune.pipeline.threed as threed
    from autotune.sbp.memory import Mode

    def cand(step, zero=0, sp=False, virtual=1, path="tensor"):
        stage = NS(problem=NS(mode=Mode(zero=zero), graph=NS(layers=[])), search={"sequence_parallel": sp},
                   fig=NS(path=path))
        return NS(step=step, virtual=virtual, plans=[stage, stage], split=[2, 1 if virtual > 2 else 2])
    runs = cand(2.5, zero=1)
    done = [cand(1.0, zero=2, path="dtensor"), cand(1.5, sp=True, path="dtensor"), cand(2.0, virtual=3), runs,
            cand(3.0, virtual=2), cand(3.5, sp=True)]
    search = NS(run=lambda: None)
    with mock.patch.object(threed, "finished", lambda *a, **k: done):
        assert threed.seeded(search, runnable=True) == (runs, done[0], True)
        assert threed.seeded(search) == (done[0], done[0], True)
        assert [threed.applies(c) for c in done] == [False, False, False, True, True, True]
