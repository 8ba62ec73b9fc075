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
    res = make_search(name).run(problem, Budget(steps=3000), np.random.default_rng(1))
    assert res.cost == pytest.approx(opt, rel=0.01)
    assert "step budget" in res.stopped


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
