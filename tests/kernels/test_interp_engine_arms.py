"""tp-mlp and the sweep's ceilings on the measurement engine, on CPUs: the step arms with the
check's host allreduce (a planted corruption from the second step is found after timing, a step
that cannot be captured or an arm that fails to start makes the verdicts unknown), and a ceiling
row on the stand-in device (``tests/calibrate/standin.py``) in place of CuPy."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from calibrate.measure import engine
from kernels.interp import sweep
from kernels.interp.cli import tp_mlp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "calibrate"))
from standin import Device, SumArm  # noqa: E402  (the CPU stand-in device of the engine's tests)
MPIEXEC = Path(sys.executable).with_name("mpiexec")
ARGS = types.SimpleNamespace(steps=2, reps=3)


def planted(from_call: int):
    """A one-rank allreduce (a copy) that adds 1 to the first element from call ``from_call`` on."""
    n = [0]

    def allreduce(t):
        n[0] += 1
        out = t.clone()
        if n[0] >= from_call:
            out.view(-1)[0] += 1.0
        return out
    return allreduce


def layer_data():
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(6, 8, generator=g, dtype=torch.float64).requires_grad_()
    w2 = torch.randn(8, 6, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(5, 6, generator=g, dtype=torch.float64).requires_grad_()
    dy = torch.randn(5, 6, generator=g, dtype=torch.float64)
    return x, w1, w2, dy


def step_arm(step):
    x, w1, w2, dy = layer_data()
    reference = tp_mlp.make_layer(torch, tp_mlp.host_allreduce(torch, MPI.COMM_SELF))
    return tp_mlp.StepArm(torch, step, reference, x, w1, w2, dy, 1e-9)


def test_a_step_corrupted_from_its_second_call_is_found_after_timing():
    arms = [("interp_eager", lambda: step_arm(tp_mlp.make_layer(torch, planted(3)))),   # 2 allreduces a step
            ("nccl_eager", lambda: step_arm(tp_mlp.make_layer(torch, planted(10 ** 9))))]
    res = engine.compare(engine.Solo(), arms, tp_mlp.eager_options(ARGS))
    bad, good = res["interp_eager"], res["nccl_eager"]
    assert bad.wrong_before == 0 and bad.wrong_after > 0 and bad.status is engine.Status.WRONG
    assert bad.timed and "after the timed calls" in bad.reason
    assert good.ok and good.wrong_before == 0 and good.wrong_after == 0 and len(good.samples_s) == ARGS.reps


def test_the_check_counts_every_wrong_output_and_gradient():
    arm = step_arm(tp_mlp.make_layer(torch, planted(1)))
    # forward: Y's first element (its backward is the identity: the weights' gradients do not see it);
    # backward: dX's first element (the allreduce is dX's last op)
    assert arm.check(7) == 2
    assert arm.max_rel_err > 1e-3
    assert step_arm(tp_mlp.make_layer(torch, planted(10 ** 9))).check(7) == 0


def test_steps_that_cannot_be_captured_make_the_graph_verdict_unknown():
    steps = {"interp": tp_mlp.make_layer(torch, planted(10 ** 9)), "nccl": tp_mlp.make_layer(torch, planted(10 ** 9))}
    graph, eager, made = tp_mlp.compare_steps(engine.Solo(), steps, step_arm, ARGS)
    assert set(made) == {"interp", "nccl", "interp_eager", "nccl_eager"}
    assert graph["interp"].status is engine.Status.ERROR and "graph capture" in graph["interp"].reason
    row = tp_mlp.row_from(5, 240, "test", graph, eager, 0.0)
    assert math.isnan(row["interp_step_us"]) and math.isnan(row["speedup"])
    assert row["interp_eager_step_us"] > 0 and row["eager_speedup"] > 0
    states = {v["target"]: v["state"] for v in row["verdicts"]}
    assert states["interp step >= NCCL's speed (graph)"] == "unknown"
    assert states["interp step >= NCCL's speed (eager)"] in ("met", "not met")
    assert row["verdict"] != "met" and not row["correct"] and "interp: error" in row["graph_error"]
    assert row["verdict"] in tp_mlp.table([row]).splitlines()[1]


def test_the_tolerance_grows_with_the_ranks_and_keeps_its_floor():
    assert tp_mlp.tolerance("float32", 2) == 1e-5 and tp_mlp.tolerance("float16", 1) == 2e-2
    assert tp_mlp.tolerance("bfloat16", 8) > tp_mlp.tolerance("bfloat16", 2) >= 2e-2


def test_an_arm_that_fails_to_start_is_a_row_with_its_reason():
    steps = {"interp": tp_mlp.make_layer(torch, planted(10 ** 9)), "nccl": tp_mlp.make_layer(torch, planted(10 ** 9))}

    def make(step):
        if step is steps["interp"]:
            raise RuntimeError("no interpreter here")
        return step_arm(step)
    graph, eager, _ = tp_mlp.compare_steps(engine.Solo(), steps, make, ARGS)
    assert eager["interp_eager"].status is engine.Status.FAILED
    row = tp_mlp.row_from(5, 240, "test", graph, eager, 0.0)
    assert math.isnan(row["interp_eager_step_us"]) and row["nccl_eager_step_us"] > 0
    assert "no interpreter here" in row["graph_error"] and row["verdict"] == "unknown"
    assert [a["name"] for a in row["arms"]] == ["interp", "nccl", "interp_eager", "nccl_eager"]


@pytest.mark.skipif(not MPIEXEC.exists(), reason="the mpich wheel's mpiexec is not installed")
def test_step_arms_on_mpi_ranks_find_one_ranks_corruption_after_timing():
    r = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, str(ROOT / "tests/kernels/tp_mlp_on_ranks.py")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    arms = {a["name"]: a for a in out["eager"]["arms"]}
    # rank 1's fresh planted arm is right before timing and wrong after it, summed over ranks
    assert arms["interp_eager"]["status"] == "wrong"
    assert arms["interp_eager"]["wrong_before"] == 0 and arms["interp_eager"]["wrong_after"] > 0
    assert arms["nccl_eager"]["status"] == "ok" and arms["nccl_eager"]["wrong_after"] == 0
    assert len(arms["nccl_eager"]["samples_s"]) == 3
    # sharing a counter, the eager interp arm of compare_steps is wrong before timing (the graph
    # comparison's warm-up passed call 3): no median, the verdict unknown
    row = out["row"]
    assert math.isnan(row["interp_eager_step_us"]) and row["verdict"] == "unknown" and not row["correct"]
    assert "interp_eager: wrong" in row["graph_error"]


# ---- the sweep's ceilings, on the stand-in device ----
def test_a_ceiling_corrupted_after_its_first_call_is_wrong_after_timing():
    dev = Device()
    arms = [("x", lambda: SumArm(dev, 64, fault_from=2, name="x")), ("nccl", lambda: SumArm(dev, 64, name="nccl"))]
    row = sweep.ceiling_row(engine.Solo(), "one-shot LL allreduce", 256, arms, 4, checked=True, reps=3)
    assert row["ceiling"] == "one-shot LL allreduce (WRONG)" and row["correct"] is False
    assert row["wrong_before"] == 0 and row["wrong_after"] > 0 and row["status"] == "wrong"
    assert math.isnan(row["us"]) and row["nccl_us"] > 0 and row["nccl_status"] == "ok"
    assert "x: wrong" in row["why"]


def test_a_ceiling_whose_nccl_arm_fails_is_unknown_with_the_reason():
    dev = Device()

    def refuse():
        raise RuntimeError("no NCCL here")
    arms = [("x", lambda: SumArm(dev, 64, name="x")), ("nccl", refuse)]
    row = sweep.ceiling_row(engine.Solo(), "one-shot LL allreduce", 256, arms, 4, checked=True, reps=3)
    assert row["ceiling"] == "one-shot LL allreduce (unknown)" and row["correct"] is False
    assert row["us"] > 0 and math.isnan(row["nccl_us"]) and "no NCCL here" in row["why"]
    assert row["gbs"] == pytest.approx(256 / (row["us"] * 1e-6) / 1e9)


def test_an_unchecked_ceiling_is_graph_timed_and_interleaved():
    dev = Device()
    arms = [("x", lambda: SumArm(dev, 64, name="x")), ("nccl", lambda: SumArm(dev, 64, name="nccl"))]
    row = sweep.ceiling_row(engine.Solo(), "graph kernel node (empty)", 0, arms, 4, checked=False, reps=3)
    assert row["ceiling"] == "graph kernel node (empty)" and "correct" not in row and row["checked"] == "no"
    assert row["us"] > 0 and row["nccl_us"] > 0 and row["gbs"] == 0.0 and row["why"] == ""
    timed = dev.ran[-6 * 4:]   # 3 rounds x 2 arms x 4 calls per graph replay, each arm first in turn
    assert [timed[i * 4] for i in range(6)] == ["x", "nccl", "nccl", "x", "x", "nccl"]


def test_a_ceiling_without_a_time_is_refused_by_the_record():
    """A ceiling that was wrong after timing (or did not run) keeps no time; the rescoring that reads it refuses."""
    from calibrate.errors import UserError
    from kernels.interp.records import SweepRecord
    rec = SweepRecord(device="stand-in", runs=[{"sweep": "s", "rows": [], "ceilings": [
        {"ceiling": "one-shot LL allreduce (WRONG)", "bytes": 1024, "us": float("nan"), "why": "3 wrong after timing"},
        {"ceiling": "one-shot LL allreduce (ok)", "bytes": 2048, "us": 4.5}]}])
    assert rec.ceiling_us("one-shot LL allreduce", 2048) == 4.5
    with pytest.raises(UserError, match="3 wrong after timing"):
        rec.ceiling_us("one-shot LL allreduce", 1024)
