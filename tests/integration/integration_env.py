"""Shared by the integration tests: real Slurm daemons, a real headless Chromium,
real MPI ranks.

A missing tool skips a test on a developer machine but fails it under CI
(env CI set), where .ci/run has installed everything and the test must prove it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def require(ok: bool, what: str) -> None:
    """Skip (locally) or fail (under CI) when a needed tool is missing."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI is set, so this is a failure, not a skip)")
    pytest.skip(what)


REPO = Path(__file__).resolve().parents[2]
ALL_COLLECTIVES = "allreduce,allgather,reducescatter,alltoall,broadcast,sendrecv"
# small sizes and few iterations: the flow is under test here, not the figures
SMALL_SWEEP = ["--min-bytes", "1K", "--max-bytes", "16K", "--factor", "2", "--iters", "3", "--warmup", "1"]
N_SIZES = 5  # 1K, 2K, 4K, 8K, 16K
RANKS = 4  # MPI ranks of the end-to-end calibration


def venv_mpiexec() -> str | None:
    """The mpiexec installed next to this interpreter (the mpich wheel's hydra), else PATH's."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def python_m(*args: str, timeout: float = 300, launcher: list[str] | None = None,
             cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``[launcher...] python -m args...`` from the repository root, output captured."""
    argv = [*(launcher or []), sys.executable, "-m", *args]
    print("$", " ".join(argv), file=sys.stderr)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          stdin=subprocess.DEVNULL)


def explain(r: subprocess.CompletedProcess) -> str:
    """The command and the tail of its output, for assertion messages."""
    out = "\n".join((r.stdout or "").splitlines()[-20:])
    err = "\n".join((r.stderr or "").splitlines()[-30:])
    return f"{' '.join(map(str, r.args))}\nexit {r.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
