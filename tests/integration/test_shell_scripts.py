"""The shell entry points parse (bash -n) and pass shellcheck."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from integration_env import REPO, require

SCRIPTS = [REPO / ".ci" / "run", *sorted((REPO / "slurm").glob("*.sh")),
           *sorted((REPO / "tests" / "integration").glob("*.sh"))]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck(script):
    require(shutil.which("shellcheck") is not None, "no shellcheck: apt-get install shellcheck")
    r = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_ci_run_is_executable():
    assert (REPO / ".ci" / "run").stat().st_mode & 0o111
    assert (REPO / "slurm" / "calibrate.sh").stat().st_mode & 0o111
