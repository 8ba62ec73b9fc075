"""The issue's simulated targets on the paper's cluster profile (aws-p3-v100, assumed)."""
import pytest

from autotune.reshard.cases import case_names, case_profile, load_case
from autotune.reshard.plan import compare
from autotune.reshard.solvers import SolverConfig
from calibrate.profile import Profile


@pytest.fixture(scope="module")
def results():
    prof = Profile.load(case_profile())
    cfg = SolverConfig(time_budget=0.2)
    return {n: compare(load_case(n).task, prof, ["send_recv", "global_allgather", "broadcast"],
                       ["greedy_in_order", "ensemble"], cfg) for n in case_names()}


@pytest.mark.parametrize("case", case_names())
def test_chosen_plan_within_5_percent_of_lower_bound(results, case):
    chosen = results[case][("broadcast", "ensemble")]
    assert chosen.lower_bound * (1 - 1e-9) <= chosen.makespan <= 1.05 * chosen.lower_bound


@pytest.mark.parametrize("case", ["3", "4", "7", "8", "9"])
def test_faster_than_the_baselines(results, case):
    chosen = results[case][("broadcast", "ensemble")].makespan
    # the paper's baselines (least-loaded sender per slice in Alpa's order); Alpa all-gathers over each slice's
    # receivers. The host-level model bounds the all-gather gain near 2x (reports/records/reshard.md)
    assert results[case][("send_recv", "greedy_in_order")].makespan > 1.4 * chosen
    alpa = results[case][("global_allgather", "greedy_in_order")].makespan
    assert 1.4 * chosen < alpa <= 2.05 * chosen
