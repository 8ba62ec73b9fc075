"""The MPI executor on 8 ranks of this CPU: every destination tile checked exactly
(plans made and run by ``autotune reshard --execute mpi``, plan files run by ``kernels reshard``)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec is not next to the python of this venv")


def mpirun(*args, ranks):
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)


def mpi_check(*args, ranks=8):
    """Plan every strategy with each solver on the paper's profile and run each plan."""
    defaults = [a for flag, value in (("--shape", "12,10,6"), ("--solvers", "naive,ensemble"))
                if flag not in args for a in (flag, value)]
    return mpirun("autotune", "reshard", "--execute", "mpi", "--profile", "aws-p3-v100", "--time-budget", "0.05",
                  "--rounds", "4", *defaults, *args, ranks=ranks)


def test_disjoint_meshes_all_strategies():
    # 4 hosts of 2 devices: (2,2) on hosts 0-1 -> (2,2) on hosts 2-3; the nine cases' spec pairs, uneven shape
    scenarios = ["S0RR@2,2:S0RR@2,2", "RRR@2,2:S0RR@2,2", "RS0R@2,2:S0RR@2,2", "RS01R@2,2:S01RR@2,2",
                 "S1RR@2,2:S0RR@2,2", "S0RR@2,2:S0RR@1,2", "S1RR@1,2:RRR@3,2", "RRR@2,1:RRR@2,2",
                 "RS0R@2,2:RRS0@2,2"]
    r = mpi_check("--shape", "13,10,6", "--devices-per-host", "2", "--solvers", "naive,ensemble",
                  *[a for s in scenarios for a in ("--scenario", s)])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln[:3] in ("OK ", "BAD") and "exchange (baseline)" not in ln]
    assert len(lines) == len(scenarios) * 4 * 2
    assert all(ln.startswith("OK ") for ln in lines)
    # the plain exchange of the same tiles beside each task's plans, every tile checked
    base = [ln for ln in r.stdout.splitlines() if "exchange (baseline)" in ln]
    assert len(base) == len(scenarios) and all(ln.startswith("OK ") and "wrong=0" in ln for ln in base)
    assert "executor model: not measured (one run a plan" in r.stdout


def test_shared_devices_and_pipelined_broadcast():
    # destination on the source devices (local copies mixed with transfers), and a slice big
    # enough that the broadcast is planned in several partitions
    r = mpi_check("--shape", "64,64,32", "--devices-per-host", "2", "--solvers", "ensemble",
                  "--scenario", "S0RR@2,2:RS01R@2,2+shared", "--scenario", "RRR@1,2:RRR@3,2")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln[:3] in ("OK ", "BAD") and "exchange (baseline)" not in ln]
    assert len(lines) == 8 and all(ln.startswith("OK ") for ln in lines)
    assert sum(ln.startswith("OK ") and "exchange (baseline)" in ln for ln in r.stdout.splitlines()) == 2
    assert any("K<=1 " not in ln for ln in lines if "broadcast" in ln)


def test_each_plan_is_predicted_by_its_executors_operations_timed_alone(tmp_path):
    """With --iters 2 or more, every distinct operation of the plans and each plan's dry run are timed
    alone after the plans, and every plan gets its executor model's prediction, its results the parts it
    came from (the figures are this VM's, not checked)."""
    r = mpirun("autotune", "reshard", "--execute", "mpi", "--profile", "aws-p3-v100", "--time-budget", "0.05",
               "--shape", "8,6,4", "--devices-per-host", "2", "--solvers", "ensemble", "--iters", "2",
               "--scenario", "RRR@1,1[0]:S1RR@1,2[0,1]", "--results", str(tmp_path / "r.json"), ranks=2)
    assert r.returncode == 0, r.stdout + r.stderr
    model = [ln for ln in r.stdout.splitlines() if " makespan " in ln and " executor " in ln]
    assert len(model) == 4 and all("(host " in ln and "x)" in ln for ln in model), r.stdout
    assert "plans within 15%" in r.stdout
    rows = json.loads((tmp_path / "r.json").read_text())["executed"]
    assert all(row["exchange_dry_s"] >= 0 for row in rows) and "exchange (baseline)" in r.stdout   # its walk too
    assert len(rows) == 4 and all(row["dry_s"] >= 0 and row["walk_s"] >= 0 and row["operations"] and all(
        kind in ("p2p", "broadcast", "allgather", "copy", "fill") and alone >= 0 and wave in (0, 1, 2)
        for kind, _, _, alone, wave in row["operations"]) for row in rows)


def test_too_few_ranks_is_a_clear_error():
    r = mpi_check("--scenario", "S0RR@2,4:S0RR@2,4", "--devices-per-host", "4", ranks=2)
    assert r.returncode == 2 and "needs 16 ranks" in r.stderr


def test_plan_written_by_the_cli_runs_exactly(tmp_path):
    plan = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "autotune", "reshard", "--src-mesh", "1,2", "--src-spec", "S1RR",
                        "--dst-mesh", "2,2", "--dst-spec", "RS01R", "--shape", "16,16,8", "--profile",
                        "aws-p3-v100", "--devices-per-host", "2", "--plan-out", str(plan)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    r = mpirun("kernels", "reshard", str(plan), ranks=6)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("OK ")
