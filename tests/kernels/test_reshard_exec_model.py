"""The resharding executor's own costs beside the planner's makespan (issue 45): terms fitted by
non-negative least squares on the other scenarios' plans, each plan predicted without its own figure."""
from __future__ import annotations

import pytest

from kernels.reshard.harness import executor_model

CALL, JOB, GROUP = 40e-6, 25e-6, 10e-6


def rows(noise=0.0):
    out = []
    for k, (scenario, jobs, groups, makespan) in enumerate([
            ("a", 1, 0, 80e-6), ("a", 1, 1, 80e-6), ("b", 2, 0, 90e-6), ("b", 2, 2, 120e-6),
            ("c", 4, 0, 60e-6), ("c", 4, 3, 60e-6), ("d", 3, 1, 200e-6)]):
        measured = makespan + CALL + JOB * jobs + GROUP * groups
        out.append({"scenario": scenario, "ok": True, "predicted_s": makespan, "jobs_busiest": jobs,
                    "groups_busiest": groups, "measured_s": measured * (1 + noise * (-1) ** k)})
    return out


def test_terms_are_recovered_and_each_plan_is_predicted_from_the_others():
    r = rows()
    model = executor_model(r)
    assert model["terms"] == pytest.approx({"call_s": CALL, "job_s": JOB, "group_s": GROUP}, rel=1e-6)
    assert all(x["predicted_exec_s"] == pytest.approx(x["measured_s"], rel=1e-6) for x in r)
    assert model["measured_over_predicted"] == pytest.approx([1.0, 1.0], rel=1e-6)


def test_a_plan_is_not_predicted_from_its_own_measurement():
    """Planted: one scenario's plans far off the others' law. Fitted on all rows, its own figures would
    pull the terms towards it; left out, its prediction stays the other scenarios' law and shows the miss."""
    r = rows()
    for x in r:
        if x["scenario"] == "d":
            x["measured_s"] *= 3
    executor_model(r)
    d = next(x for x in r if x["scenario"] == "d")
    assert d["predicted_exec_s"] == pytest.approx(d["predicted_s"] + CALL + 3 * JOB + GROUP, rel=1e-6)
    assert d["measured_s"] / d["predicted_exec_s"] == pytest.approx(3.0, rel=1e-6)


def test_one_scenario_has_no_prediction_and_rows_not_ok_are_left_out():
    r = [x for x in rows() if x["scenario"] == "a"] + [{"scenario": "b", "ok": False, "measured_s": None}]
    model = executor_model(r)
    assert "predicted_exec_s" not in r[0] and model["measured_over_predicted"] == []
