"""A tied logits layer whose weight is placed as the embedding's holds one tensor with it, so one gradient and
one sync (the embedding's): the plan's cost leaves out the logits' own all-reduce of that weight. Checked
against the closed form on data parallelism, and every local cost the searches use against the whole plan's."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from calibrate.profile import Profile
from models import load_model
from autotune.sbp.baselines import data_parallel
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem, sync_steps
from autotune.sbp.mesh import Cluster
from autotune.plan.build import build as build_plan

TIED = {"layers": 2, "hidden": 512, "heads": 4, "ffn": 2048, "sequence": 16, "vocabulary": 8192, "batch": 8,
        "micro_batch": 4, "tied": True}


def problem(objective: str, tied: bool = True) -> Problem:
    """On the default profile with no overlap slowdown: the closed forms here are of the collectives' times."""
    g = load_model("gpt", None, dict(TIED, tied=tied))
    p = Profile.load("h200-nvlink+ib400")
    p = replace(p, compute=replace(p.compute, overlap={k: 1.0 for k in ("all_reduce", "all_gather", "reduce_scatter")}))
    return Problem(g, Coster(p, Cluster(2, 2)), None, objective=objective)


@pytest.mark.parametrize("objective", ["step", "comm"])
def test_data_parallel_syncs_the_shared_table_once(objective):
    pr = problem(objective)
    t, e = pr.tied_pair
    a = data_parallel(pr)
    weight = [st for name, st in sync_steps(pr.choices[t][a[t]], pr.cluster, pr.grad_bytes, pr.mode) if name == "weight"]
    assert len(weight) == 1 and weight[0].axes                      # replicated, synced over the data axes
    assert pr.tied_saved(a) == pytest.approx(pr.coster.step_time(weight[0]), rel=1e-12)
    plan = build_plan(pr, a, "data parallel")
    logits = next(lay for lay in plan.layers if lay.name == pr.ops[t].layer.name)
    assert not [c for c in logits.collectives if c.phase == "grad-sync" and c.tensor == "weight"]
    if objective == "step":  # the sync is exposed (large weights, few tokens): the saving shows in the step
        S = sum(float(c * pr.node_sync[v][i]) for v, (i, c) in enumerate(zip(a, pr.counts)))
        W = sum(float(c * pr.node_bwd[v][i]) for v, (i, c) in enumerate(zip(a, pr.counts)))
        assert S - pr.tied_saved(a) - W > float(pr.node_sync[pr.first][a[pr.first]])
        assert pr.exposed_sync(a) == pytest.approx(S - pr.tied_saved(a) - W, rel=1e-12)
    assert plan.costs.grad_sync_s == pytest.approx(
        sum(float(c * pr.node_sync[v][i]) for v, (i, c) in enumerate(zip(a, pr.counts))) - pr.tied_saved(a))


def test_an_untied_model_saves_nothing():
    pr = problem("step", tied=False)
    assert pr.tied_pair is None and pr.tied_saved(data_parallel(pr)) == 0.0


@pytest.mark.parametrize("objective", ["step", "comm"])
def test_local_costs_of_the_tied_pair_are_exact_cost_differences(objective):
    pr = problem(objective)
    t, e = pr.tied_pair
    rng = np.random.default_rng(1)
    saved_some = False
    for _ in range(20):
        a = [int(rng.integers(n)) for n in pr.sizes]
        a[e] = data_parallel(pr)[e] if rng.random() < 0.5 else a[e]
        for v in (t, e):
            loc, cand = pr.local(a, v), pr.candidates(a, v)
            for i in rng.integers(pr.sizes[v], size=8):
                b = list(a)
                b[v] = int(i)
                saved_some |= pr.tied_saved(b) > 0
                assert loc[i] - loc[a[v]] == pytest.approx(pr.raw_cost(b) - pr.raw_cost(a), rel=1e-9, abs=1e-15)
                assert cand[i] == pytest.approx(pr.raw_cost(b), rel=1e-9)
        for u, w in pr.pairs:
            if not {u, w} & {t, e}:
                continue
            pl = pr.pair_local(a, u, w)
            b = list(a)
            b[u], b[w] = int(rng.integers(pr.sizes[u])), int(rng.integers(pr.sizes[w]))
            assert pl[b[u], b[w]] - pl[a[u], a[w]] == pytest.approx(pr.raw_cost(b) - pr.raw_cost(a), rel=1e-9,
                                                                  abs=1e-15)
    assert saved_some
