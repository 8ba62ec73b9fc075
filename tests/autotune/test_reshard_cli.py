import json
import subprocess
import sys

import pytest

from autotune.reshard.cases import load_case
from autotune.reshard.plan import Plan, make_plan
from autotune.reshard.solvers import SolverConfig
from calibrate.profile import Profile


def run(*args):
    return subprocess.run([sys.executable, "-m", "autotune", "reshard", *args], capture_output=True, text=True,
                          timeout=120)


def test_case_prints_strategies_bound_and_plan(tmp_path):
    r = run("--case", "3", "--plan-out", str(tmp_path / "p.json"), "--time-budget", "0.1")
    assert r.returncode == 0, r.stderr
    for word in ("send_recv", "local_allgather", "global_allgather", "broadcast", "lower bound", "chosen"):
        assert word in r.stdout
    plan = Plan.load(tmp_path / "p.json")
    assert plan.strategy == "broadcast" and plan.profile == "aws-p3-v100" and len(plan.units) == 4


def test_explicit_task_and_results(tmp_path):
    r = run("--src-mesh", "2,4", "--src-spec", "S0RR", "--dst-mesh", "2,4", "--dst-spec", "S0RR",
            "--shape", "64,64,32", "--profile", "aws-p3-v100", "--results", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["kind"] == "reshard" and len(res["cases"]) == 1


@pytest.mark.parametrize("args,needle", [
    (["--src-mesh", "2,4", "--src-spec", "S0RRR", "--dst-mesh", "2,4", "--dst-spec", "S0RR", "--shape", "8,8,8",
      "--profile", "aws-p3-v100"], "has 4 dimensions"),
    (["--src-mesh", "2,4", "--src-spec", "S01RR", "--dst-mesh", "2,4", "--dst-spec", "S0RR", "--shape", "4,8,8",
      "--profile", "aws-p3-v100"], "finer than the dimension allows"),
    (["--src-mesh", "2,5", "--src-spec", "S0RR", "--dst-mesh", "2,4", "--dst-spec", "S0RR", "--shape", "8,8,8",
      "--profile", "aws-p3-v100"], "devices per host"),
    (["--case", "12"], "unknown case"),
    ([], "nothing to do"),
])
def test_bad_input_is_one_line(args, needle):
    r = run(*args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_plan_json_round_trips(tmp_path):
    c = load_case("6")
    plan = make_plan(c.task, Profile.load("aws-p3-v100"), cfg=SolverConfig(time_budget=0.05))
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again.to_dict() == plan.to_dict()
    assert again.task == plan.task and again.jobs == plan.jobs and again.units == plan.units


def test_report_section_builds_from_results(tmp_path):
    from reports.html import write_report
    from reports.sections import builder

    r = run("--case", "4", "--pipeline", "u-transformer-like", "--micro-batches", "6", "--time-budget", "0.05",
            "--results", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    sections = builder("reshard")([tmp_path / "r.json"])
    assert [s.title for s in sections][:2] == ["Cross-mesh resharding: strategies and schedules",
                                              "Pipeline schedules: u-transformer-like"]
    html = write_report(tmp_path / "r.html", "reshard", sections).read_text()
    assert html.count("<svg") >= 3
