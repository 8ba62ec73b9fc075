"""The MPI backend's yielding wait (``Backend.yield_while_waiting``, set by --nodes-share-cores for groups across
nodes): on ranks that share cores a waiting rank gives its core to the others instead of spinning until the
scheduler's tick. Three MPI ranks on this machine, one joining late."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from calibrate.collectives import Collective

MPIEXEC = Path(sys.executable).with_name("mpiexec")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="the mpich wheel's mpiexec is not installed")


def on_ranks(setting: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([str(MPIEXEC), "-n", "3", sys.executable, str(ROOT / "tests/calibrate/yield_wait_on_ranks.py"),
                        setting], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_waiting_rank_yields_its_core_and_every_collective_stays_right():
    got = on_ranks("on")
    assert set(got) == {c.value for c in Collective}
    for coll, r in got.items():
        assert r["wrong"] == 0, (coll, r)
        assert r["yields"] > 0, (coll, r)  # rank 1 waited 30 ms for rank 0


def test_by_default_the_wait_is_mpi_s_own():
    got = on_ranks("off")
    assert all(r["wrong"] == 0 and r["yields"] == 0 for r in got.values()), got
