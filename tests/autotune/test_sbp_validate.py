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


def test_validate_rejects_a_world_that_does_not_match(capsys):
    from autotune.__main__ import main
    assert main(["validate", "--nodes", "2", "--gpus-per-node", "2", "--profile", "gcp-a100"]) == 2
    assert "MPI ranks" in capsys.readouterr().err
