"""The Megatron-style 3-D baseline (``autotune.pipeline.threed``) on a small GPT: its degrees, the best
simulated step among them, and recomputation / FSDP where no plain plan fits."""
import math

import pytest

from autotune.pipeline.search import PipelineConfig, PipelineSearch
from autotune.pipeline.threed import candidates, finished, megatron_3d, seeded, stage_plans
from autotune.sbp.memory import NONE
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
    few = [c for c in finished(ps) if c.micro_batches < c.stages]
    assert few
    for c in few:
        m, p = c.micro_batches, c.stages
        assert [x.problem.inflight for x in c.plans] == [min(p - i, m) for i in range(p)]
        for i in range(p):
            kinds = [iv.kind for iv in sorted(c.result.intervals, key=lambda iv: iv.start)
                     if iv.lane == f"stage {i}" and iv.kind in ("F", "B")]
            w = min(p - i, m)
            assert kinds == ["F"] * w + ["B", "F"] * (m - w) + ["B"] * w
