"""One small calibration (4 MPI ranks, run + fit + report), shared by the
end-to-end test and the browser test."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from integration_env import ALL_COLLECTIVES, RANKS, SMALL_SWEEP, explain, python_m, require, venv_mpiexec


@dataclass
class Calibration:
    results: Path
    profile: Path
    report: Path
    run_stderr: str


@pytest.fixture(scope="session")
def calibration(tmp_path_factory) -> Calibration:
    mpiexec = venv_mpiexec()
    require(mpiexec is not None, "no mpiexec next to the interpreter or on PATH: pip install mpich")
    root = tmp_path_factory.mktemp("calibration")
    results = root / "results"
    run = python_m("calibrate", "run", "--backend", "mpi", "--collectives", ALL_COLLECTIVES, *SMALL_SWEEP,
                   "--mode", "host", "--check", "--out", str(results),
                   launcher=[mpiexec, "-n", str(RANKS)])
    assert run.returncode == 0, explain(run)
    profile = results / "profile.json"
    fit = python_m("calibrate", "fit", str(results), "-o", str(profile))
    assert fit.returncode == 0, explain(fit)
    report = results / "report.html"
    rep = python_m("reports", str(results), str(profile), "-o", str(report))
    assert rep.returncode == 0, explain(rep)
    return Calibration(results, profile, report, run.stderr)
