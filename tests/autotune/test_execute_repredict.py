"""tests/gpu/execute_repredict.py on the recorded GPU run 8: every plan is found again by its placements
(data parallelism's re-prediction is exactly data parallelism's plan priced now), and the table prints."""
import json
import sys
from pathlib import Path

import pytest

from calibrate.profile import Profile
from models import load_model
from autotune.sbp.baselines import data_parallel
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.plan.build import build as build_plan

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "reports/records/execute-h200x2-2026-11-23-run8"
sys.path.insert(0, str(ROOT / "tests/gpu"))
import execute_repredict  # noqa: E402


def test_plans_are_found_by_placements_and_priced_now(capsys):
    assert execute_repredict.main([str(RUN)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 + 15 + 1 and out[-1].startswith("worst step error")
    prof = Profile.load(str(RUN / "profile.json"))
    g = load_model("gpt", None, {"layers": 4, "hidden": 4096, "heads": 32, "sequence": 1024, "vocabulary": 32768,
                                 "batch": 16, "micro_batch": 8})
    pr = Problem(g, Coster(prof, Cluster(1, 2)), 120 * 2**30, objective="step")
    plans = json.loads((RUN / "plans.json").read_text())
    dp = next(p for p in plans["baselines"] if p["strategy"] == "data parallel")
    assert execute_repredict.assignment(pr, dp) == data_parallel(pr)
    want = build_plan(pr, data_parallel(pr), "dp").costs.step_s
    row = next(line for line in out if line.startswith("data parallel"))
    assert float(row.split()[3]) == pytest.approx(want * 1e3, abs=0.005)
