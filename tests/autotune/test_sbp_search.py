"""Search algorithms against the brute-force optimum on small cases."""
import itertools

import numpy as np
import pytest

from calibrate.profile import Profile
from models import load_model
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.sbp.search import Budget, make_search
from autotune.sbp.baselines import best_mesh, megatron_assignment


@pytest.fixture(scope="module")
def problem():
    g = load_model("mlp", None, {"dims": [256, 128, 512, 64], "batch": 32, "micro_batch": 32})
    return Problem(g, Coster(Profile.load("gcp-a100"), Cluster(2, 4)), None)


def brute(problem):
    return min(problem.cost(list(a)) for a in itertools.product(*(range(n) for n in problem.sizes)))


def test_exhaustive_matches_brute_force(problem):
    res = make_search("exhaustive").run(problem, Budget(), np.random.default_rng(0))
    assert res.cost == pytest.approx(brute(problem), rel=1e-12)
    assert res.cost == pytest.approx(problem.cost(res.assignment), rel=1e-12)
    assert res.stopped == "searched every plan"


@pytest.mark.parametrize("name", ["cd", "mh"])
def test_heuristics_reach_the_optimum(problem, name):
    opt = brute(problem)
    search = make_search(name)
    search.relaxation = False  # the heuristic on its own (cd's start from the relaxation: below)
    res = search.run(problem, Budget(steps=3000), np.random.default_rng(1))
    assert res.cost == pytest.approx(opt, rel=0.01)
    assert "step budget" in res.stopped


def test_coordinate_descent_stops_when_the_relaxation_proves_its_plan_optimal(problem):
    # no memory limit and the communication objective: the relaxation's first program is exact, its bound
    # the optimum, and the search stops there rather than on its step budget
    res = make_search("cd").run(problem, Budget(steps=3000), np.random.default_rng(1))
    assert res.cost == pytest.approx(brute(problem), rel=1e-12)
    assert res.bound == pytest.approx(res.cost, rel=1e-12) and res.stopped.startswith("optimal")


def test_random_search_stops_on_its_budget(problem):
    res = make_search("random").run(problem, Budget(steps=50), np.random.default_rng(2))
    assert res.steps == 50 and res.cost >= brute(problem)


def test_search_beats_or_matches_megatron(problem):
    _, mega, _ = best_mesh(problem, megatron_assignment)
    assert brute(problem) <= mega


def test_partial_sums_help_the_wide_transformer():
    # AutoDDL Fig. 3 setting, scaled down: the full space is at least as good as S/B only.
    g = load_model("gpt", None, {"layers": 2, "hidden": 512, "heads": 8, "sequence": 64, "vocabulary": 1024,
                                 "batch": 16, "micro_batch": 16})
    coster = Coster(Profile.load("piz-daint"), Cluster(16, 1))
    full = Problem(g, coster, None)
    sb = Problem(g, coster, None, allow_partial=False)
    f = make_search("cd").run(full, Budget(steps=400), np.random.default_rng(0))
    s = make_search("cd").run(sb, Budget(steps=400), np.random.default_rng(0))
    assert f.cost <= s.cost * 1.0000001


def test_pair_local_matches_total_cost_differences(problem):
    # pair_local(u, v)[i, j] - pair_local[a_u, a_v] equals the change of the whole plan's cost
    rng = np.random.default_rng(3)
    a = problem.random_assignment(rng)
    base = problem.cost(a)
    for u, v in problem.pairs:
        joint = problem.pair_local(a, u, v)
        for i, j in [(0, 0), (problem.sizes[u] - 1, problem.sizes[v] - 1), (1, problem.sizes[v] // 2)]:
            b = list(a)
            b[u], b[v] = i, j
            assert problem.cost(b) - base == pytest.approx(joint[i, j] - joint[a[u], a[v]], rel=1e-9, abs=1e-15)


def test_pair_local_masks_plans_over_the_memory_limit():
    g = load_model("mlp", None, {"dims": [256, 128, 512, 64], "batch": 32, "micro_batch": 32})
    free = Problem(g, Coster(Profile.load("gcp-a100"), Cluster(2, 4)), None)
    a = free.min_memory_assignment()
    limit = (free.min_memory + float(np.median([free.memory_of(free.random_assignment(np.random.default_rng(s)))
                                                 for s in range(20)]))) / 2
    tight = Problem(g, Coster(Profile.load("gcp-a100"), Cluster(2, 4)), limit)
    for u, v in tight.pairs:
        joint = tight.pair_local(a, u, v)
        for i in range(tight.sizes[u]):
            for j in range(tight.sizes[v]):
                b = list(a)
                b[u], b[v] = i, j
                assert np.isfinite(joint[i, j]) == tight.feasible(b)


def test_joint_moves_escape_the_mlp_local_minimum():
    # AutoDDL §4.6 MLP at 128 nodes: single-layer line searches from the least-memory plan stop at
    # 1.023 x the optimum; one joint move on the middle pair of layers reaches the optimum.
    g = load_model("mlp")
    pr = Problem(g, Coster(Profile.load("piz-daint"), Cluster(128, 1)), None, precompute_tables=True)
    opt = make_search("dp").run(pr, Budget(), np.random.default_rng(0)).cost
    for name in ("cd", "mh"):
        search = make_search(name)
        search.relaxation = False  # the line searches on their own, not started at the optimum
        r = search.run(pr, Budget(steps=30), np.random.default_rng(0))
        assert r.cost == pytest.approx(opt, rel=1e-9), name


def test_descents_that_reach_a_known_sweep_start_end_at_that_descents_fixed_point(problem):
    # the restarts' memo (``CoordinateDescent._descend``'s ``ends``): a descent is a function of the plan its
    # sweep starts from, so one that meets a sweep start of an earlier descent ends where that one ended
    from autotune.sbp.searchbase import Clock
    least = problem.min_memory
    full = Problem(problem.graph, problem.coster, least + 0.3 * (sum(m.max() for m in problem.mem) - least))
    cd = make_search("cd")
    for pr in (problem, full):
        pairs = pr.pairs if pr.tables.precomputed else []
        clock = Clock(Budget(), None, "cd")
        rng = np.random.default_rng(3)
        starts = [pr.random_assignment(rng) for _ in range(40)]
        ends: dict = {}
        fresh = []
        for start in starts:
            a, b = list(start), list(start)
            cd._descend(pr, a, pr.cost(a), clock, pairs)
            cd._descend(pr, b, pr.cost(b), clock, pairs, ends)
            assert a == b
            fresh.append(a)
        assert all(tuple(s) in ends for s in starts)
        for start, end in zip(starts, fresh):  # every start now known: the memo alone answers
            again = list(start)
            cd._descend(pr, again, pr.cost(again), clock, pairs, ends)
            assert again == end and ends[tuple(start)] == tuple(end)
        assert len({tuple(e) for e in fresh}) < len(fresh)  # descents met: the memo had something to answer


def test_coordinate_descent_descends_from_the_other_starts_too(problem):
    """``others`` (a neighbouring problem's plans) are first starts beside ``start``: given the optimum among
    them, a search whose budget ends after one sweep returns it, where from the least-memory plan alone it
    stops above it."""
    opt = min(itertools.product(*(range(n) for n in problem.sizes)), key=lambda a: problem.cost(list(a)))
    search = make_search("cd")
    search.relaxation = False
    sweep = Budget(steps=len(problem.sizes))
    alone = search.run(problem, sweep, np.random.default_rng(0))
    assert alone.cost > problem.cost(list(opt)) * (1 + 1e-9)
    seeded = search.run(problem, sweep, np.random.default_rng(0), None, [problem.min_memory_assignment(), list(opt)])
    assert seeded.cost == pytest.approx(problem.cost(list(opt)), rel=1e-12)
