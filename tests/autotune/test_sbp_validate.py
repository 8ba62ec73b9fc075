"""autotune validate under MPI (4 ranks, mpi backend): measured vs predicted, Spearman."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = Path(sys.executable).parent / "mpiexec"


@pytest.mark.skipif(not MPIEXEC.exists() and not shutil.which("mpiexec"), reason="no mpiexec")
def test_validate_mpi_four_ranks(tmp_path):
    exe = str(MPIEXEC) if MPIEXEC.exists() else shutil.which("mpiexec")
    cmd = [exe, "-n", "4", sys.executable, "-m", "autotune", "validate", "--backend", "mpi", "--profile", "gcp-a100",
           "--hidden", "256", "--heads", "4", "--sequence", "128", "--vocabulary", "1024", "--batch", "8",
           "--micro-batch", "8", "--iters", "3", "--warmup", "1", "--plans", "8", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Spearman rank correlation" in r.stdout
    d = json.loads((tmp_path / "validate.json").read_text())
    assert len(d["plans"]) == 8
    assert all(p["measured_s"] > 0 and p["predicted_s"] > 0 for p in d["plans"])
    assert -1.0 <= d["spearman"] <= 1.0


@pytest.mark.skipif(not MPIEXEC.exists() and not shutil.which("mpiexec"), reason="no mpiexec")
def test_validate_on_two_nodes_sharing_cores_times_every_group_and_splits_by_tier(tmp_path):
    # 4 ranks seen as 2 nodes x 2: the intra-node groups timed one node at a time (--nodes-share-cores), the
    # groups across nodes all at once; every collective gets a time, and each plan's figures split by tier add up
    exe = str(MPIEXEC) if MPIEXEC.exists() else shutil.which("mpiexec")
    cmd = [exe, "-n", "4", sys.executable, "-m", "autotune", "validate", "--backend", "mpi", "--profile", "gcp-a100",
           "--nodes", "2", "--gpus-per-node", "2", "--nodes-share-cores", "--hidden", "128", "--heads", "4",
           "--sequence", "64", "--vocabulary", "512", "--batch", "8", "--micro-batch", "8", "--iters", "1",
           "--warmup", "1", "--reps", "3", "--min-batch-ms", "2", "--plans", "4", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((tmp_path / "validate.json").read_text())
    assert d["nodes_share_cores"] is True and len(d["plans"]) == 4
    assert d["reps"] == 3 and d["min_batch_s"] == pytest.approx(2e-3)
    colls = d["collectives"]
    assert {c["tier"] for c in colls} == {"intra", "inter"}
    assert all(c["measured_s"] > 0 and c["predicted_s"] > 0 for c in colls)
    assert all((c["nodes"] == 1) == (c["tier"] == "intra") for c in colls)
    for p in d["plans"]:
        assert sum(t["measured_s"] for t in p["tiers"].values()) == pytest.approx(p["measured_s"], rel=1e-9)
    # every plan's collectives, weighted by how often each plan issues them, are what the plans sum to
    assert sum(c["plans_measured_s"] for c in colls) == pytest.approx(sum(p["measured_s"] for p in d["plans"]),
                                                                      rel=1e-9)
    assert "per collective" in r.stdout and " inter " in r.stdout


def test_validate_rejects_a_world_that_does_not_match(capsys):
    from autotune.__main__ import main
    assert main(["validate", "--nodes", "2", "--gpus-per-node", "2", "--profile", "gcp-a100"]) == 2
    assert "MPI ranks" in capsys.readouterr().err



@pytest.mark.parametrize("flag, value, says", [("--reps", "0", "--reps 0 must be at least 1"),
                                               ("--min-batch-ms", "-1", "--min-batch-ms -1 must be at least 0")])
def test_validate_rejects_bad_timing_options_before_starting(capsys, flag, value, says):
    from autotune.__main__ import main
    assert main(["validate", flag, value, "--profile", "gcp-a100"]) == 2
    assert says in capsys.readouterr().err


def test_validate_rejects_a_batch_length_that_is_not_a_number(capsys):
    from autotune.__main__ import main
    assert main(["validate", "--min-batch-ms", "nan", "--profile", "gcp-a100"]) == 2
    assert "not a finite number" in capsys.readouterr().err
