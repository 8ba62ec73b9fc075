"""slurm/calibrate.sh on a real one-node Slurm cluster started for the test
(munged, slurmctld, slurmd on localhost; see slurm_local): `sbatch --wait` runs
`srun python -m calibrate run --backend mpi` on small sizes, then fit and the
report; submitting again on the same RESULTS resumes instead of measuring again."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pandas as pd
import pytest

from calibrate.profile import Profile
from integration_env import N_SIZES, REPO, require
from slurm_local import SlurmCluster, missing_binaries

pytestmark = pytest.mark.slow

SCRIPT = REPO / "slurm" / "calibrate.sh"
# a reduction, a gather and point-to-point: enough to prove the flow under srun
# (test_calibrate_e2e covers all six collectives)
COLLECTIVES = "allreduce,allgather,sendrecv"
TASKS = max(2, min(4, os.cpu_count() or 2))
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = missing_binaries()
    require(not missing, f"Slurm is not installed (missing {', '.join(missing)}): "
                         f"apt-get install slurmctld slurmd slurm-client munge")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


def submit(cluster: SlurmCluster, workdir, results) -> tuple[subprocess.CompletedProcess, str]:
    """sbatch --wait the calibration job; return sbatch's result and the job's output."""
    settings = {
        "BACKEND": "mpi", "MODE": "host", "COLLECTIVES": COLLECTIVES,
        "MIN_BYTES": "1K", "MAX_BYTES": "16K", "ITERS": "3", "WARMUP": "1",
        "RESULTS": str(results), "PYTHON": sys.executable,
    }
    # command-line options override the script's #SBATCH lines: one node, no GPU GRES here
    argv = ["sbatch", "--wait", "--parsable", "--nodes=1", f"--ntasks-per-node={TASKS}", "--overcommit",
            "--gpus-per-node=0", "--time=00:10:00", str(SCRIPT)]
    try:
        r = cluster.run(argv, timeout=JOB_TIMEOUT_S, extra_env=settings, cwd=workdir)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job ran past {JOB_TIMEOUT_S} s:\n{cluster.logs()}")
    job = r.stdout.strip().split(";")[0]
    out = workdir / f"commtune-calibrate_{job}.out"  # the script's --output=%x_%j.out
    log = out.read_text() if out.exists() else f"(no job output {out.name})"
    assert r.returncode == 0, f"sbatch exit {r.returncode}\n{r.stderr}\n--- job output\n{log}\n{cluster.logs()}"
    return r, log


def test_sbatch_calibrates_fits_and_reports(cluster, tmp_path):
    results = tmp_path / "results"
    _, log = submit(cluster, tmp_path, results)

    # under Slurm the ranks come from srun, with the PMI that the mpich wheel speaks
    assert re.search(r"measuring: srun --mpi=pmi2 ", log), log
    meta = json.loads((results / "meta.json").read_text())
    assert meta["kind"] == "calibration"
    assert meta["config"]["world_size"] == TASKS
    assert meta["config"]["hosts"] == [cluster.node_name]

    stats = pd.read_csv(results / "stats.csv")
    phase = pd.read_csv(results / "points.csv")  # the script refines by default: sweep and refined sizes
    stats = stats.merge(phase[["group", "collective", "bytes", "phase"]], on=["group", "collective", "bytes"])
    world = stats[(stats["ranks"] == TASKS) & (stats["phase"] == "sweep")]
    assert sorted(world["collective"].unique()) == sorted(COLLECTIVES.split(","))
    assert len(world) == N_SIZES * len(COLLECTIVES.split(","))
    assert (stats.loc[stats["phase"] == "sweep", "wrong"] == 0).all()
    assert set(stats["phase"]) <= {"sweep", "refine"} and "--refine" in meta["command"]

    profile = Profile.load(results / "profile.json")
    assert profile.collectives("intra")
    html = (results / "report.html").read_text()
    assert '<figure class="fig"><svg' in html

    # submitted again on the same RESULTS: resumes, measures nothing twice
    before = (results / "stats.csv").read_text()
    _, log2 = submit(cluster, tmp_path, results)
    assert "resuming into existing" in log2, log2
    assert (results / "stats.csv").read_text() == before


def test_plain_bash_outside_slurm_uses_mpiexec(tmp_path):
    """Started with bash and no allocation, the script launches with mpiexec."""
    results = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(BACKEND="mpi", NP="2", COLLECTIVES="allreduce,sendrecv", MIN_BYTES="1K", MAX_BYTES="4K",
               ITERS="3", WARMUP="1", RESULTS=str(results), PYTHON=sys.executable)
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=JOB_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-4000:]
    assert re.search(r"measuring: \S*mpiexec -n 2 ", r.stderr), r.stderr
    assert json.loads((results / "meta.json").read_text())["config"]["world_size"] == 2
    assert (results / "profile.json").exists() and (results / "report.html").exists()


def test_script_reports_a_bad_launcher_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(LAUNCHER="ssh", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == \
        "calibrate.sh: error: LAUNCHER=ssh is not supported: use srun or mpiexec"
