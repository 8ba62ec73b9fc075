"""slurm/calibrate.sh on a real Slurm cluster of two nodes: network namespaces on
one machine (netns_cluster), one slurmd per node (slurm_netns), the link between
the nodes shaped with tbf to a known rate. MPI between the nodes over TCP
(UCX's tcp transport on the node's veth), within a node over shared memory.

What must hold: the job fits a profile with an intra and an inter tier whose
inter bandwidth is the shaped rate (within 10%), at two rates; autotune's plans
replayed across the nodes rank and cost as the profile predicts; the health
check names a link shaped slower than the others; a node lost mid-job fails
the job with a clear message and a resubmission resumes without measuring a
point twice; bad input ends the job with a clear message, never a hang.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from calibrate.collectives import Collective, busbw_factor
from calibrate.profile import Group, Profile
from integration_env import REPO, require
from netns_cluster import NetnsCluster, unavailable
from slurm_local import missing_binaries
from slurm_netns import MultiNodeSlurm

pytestmark = pytest.mark.slow

SCRIPT = REPO / "slurm" / "calibrate.sh"
LAUNCH = REPO / "tests" / "integration" / "netns_launch.sh"
NODES, PER_NODE = 2, 2
RATE_MBIT = 400.0
JOB_TIMEOUT_S = 240
# MPI between the namespaces over TCP on the node's veth (UCX would otherwise use shared memory
# between all ranks of the machine, whatever their hostname); within a node MPICH's shared memory
MPI_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"}
# bandwidth dominates above 1 MiB at these rates (alpha ~0.1-1 ms, 1 MiB ~ 20 ms)
SWEEP = {"MIN_BYTES": "4K", "MAX_BYTES": "4M", "FACTOR": "4", "ITERS": "3", "WARMUP": "1", "REFINE": "0"}
COLLECTIVES = "allreduce,allgather,reducescatter,alltoall,broadcast,sendrecv"


def need_namespaces() -> None:
    why = unavailable()
    require(why is None, f"no test cluster of namespaces: {why}")
    missing = missing_binaries()
    require(not missing, f"Slurm is not installed (missing {', '.join(missing)}): "
                         f"apt-get install slurmctld slurmd slurm-client munge")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    need_namespaces()
    nodes = NetnsCluster(NODES, RATE_MBIT)
    try:
        nodes.start()
        s = MultiNodeSlurm(tmp_path_factory.mktemp("slurm2"), nodes)
        try:
            s.start()
            yield s
        finally:
            s.stop()
    finally:
        nodes.stop()


def submit(slurm: MultiNodeSlurm, workdir: Path, results: Path, sbatch: list[str] | None = None,
           wait: bool = True, **settings) -> tuple[int, str, str]:
    """sbatch (--wait) the calibration on both nodes; (exit status, job id, job output)."""
    env = {"BACKEND": "mpi", "MODE": "host", "COLLECTIVES": COLLECTIVES, **SWEEP, "RESULTS": str(results),
           "PYTHON": sys.executable, "PYTHONPATH": str(REPO), **MPI_ENV, **settings}
    argv = ["sbatch", "--parsable", *(["--wait"] if wait else []), f"--nodes={NODES}",
            f"--ntasks-per-node={PER_NODE}", "--overcommit", "--gpus-per-node=0", "--time=00:10:00",
            *(sbatch or []), str(SCRIPT)]
    try:
        r = slurm.run(argv, timeout=JOB_TIMEOUT_S, extra_env=env, cwd=workdir)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job ran past {JOB_TIMEOUT_S} s:\n{slurm.logs()}")
    job = r.stdout.strip().split(";")[0]
    return r.returncode, job, job_log(workdir, job) + r.stderr


def job_log(workdir: Path, job: str) -> str:
    out = workdir / f"commtune-calibrate_{job}.out"
    return out.read_text() if out.exists() else f"(no job output {out.name})"


def inter_busbw_mbit(profile: Profile, coll: str, ranks: int) -> float:
    """The fitted bus bandwidth (Mbit/s) on the inter tier at 4 MiB."""
    return profile.busbw(coll, 4 * 2 ** 20, Group(ranks, NODES)) * 8 / 1e6


@pytest.fixture(scope="module")
def calibrated(slurm, tmp_path_factory):
    work = tmp_path_factory.mktemp("job")
    results = work / "results"
    rc, job, log = submit(slurm, work, results)
    assert rc == 0, f"job {job} failed\n{log}\n{slurm.logs()}"
    return work, results, log


def test_two_node_job_fits_intra_and_inter_tiers(calibrated):
    work, results, log = calibrated
    assert re.search(r"measuring: .*srun --mpi=pmi2 ", log), log
    meta = json.loads((results / "meta.json").read_text())
    assert meta["config"]["hosts"] == ["node0", "node1"] and meta["nodes"] == NODES
    stats = pd.read_csv(results / "stats.csv")
    assert set(stats["tier"]) == {"intra", "inter"}
    assert (stats["wrong"] == 0).all()
    profile = Profile.load(results / "profile.json")
    assert profile.collectives("intra") == profile.collectives("inter") == sorted(COLLECTIVES.split(","))
    html = (results / "report.html").read_text()
    assert "inter" in html and "intra" in html
