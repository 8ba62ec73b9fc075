"""Rank, world and rendezvous of the launched processes: torchrun, MPI (Open MPI,
MPICH) or Slurm, read from their environment variables (no torch needed)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from calibrate.errors import UserError

LAUNCHERS = (  # (rank, world, local rank, processes on this host) variables, in order of preference
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH / Hydra
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),  # srun
)


@dataclass(frozen=True)
class Launch:
    rank: int
    world: int
    local_rank: int
    launcher: str
    local_world: int = 1  # the processes on this host (the launcher's figure, else the world)


def launch_env(environ=None) -> Launch:
    env = os.environ if environ is None else environ
    for r, w, lr, lw in LAUNCHERS:
        if r in env and w in env:
            local = env.get(lw, "")
            return Launch(int(env[r]), int(env[w]), int(env.get(lr, env[r])), r,
                          int(local) if local.isdigit() else int(env[w]))
    return Launch(0, 1, 0, "none")


def rendezvous(launch: Launch) -> tuple[str, str]:
    """MASTER_ADDR and MASTER_PORT: given, or (under MPI) rank 0's host and a free port."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return addr, port
    if launch.launcher in ("OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        from mpi4py import MPI

        mine = None
        if launch.rank == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                mine = (socket.gethostname(), str(s.getsockname()[1]))
        return MPI.COMM_WORLD.bcast(mine, root=0)
    if launch.world == 1 or os.environ.get("SLURM_NNODES", "1") == "1":
        return addr or "127.0.0.1", port or str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000)
    raise UserError("several nodes under srun without MASTER_ADDR: export MASTER_ADDR (the first node) and MASTER_PORT")


MAX_STEPS = 100_000  # training steps (timed and profiled) one run may take


def check_steps(steps: int, warmup: int, profile_steps: int) -> None:
    """The step counts a run takes: at least one step timed after the warm-up steps (which the median
    leaves out), no negative count; a ``UserError`` naming the fix otherwise, before any step runs."""
    if steps < 1 or warmup < 0 or profile_steps < 0:
        raise UserError("--steps must be at least 1, --warmup and --profile-steps non-negative")
    if steps + profile_steps > MAX_STEPS:
        raise UserError(f"--steps {steps} and --profile-steps {profile_steps} are over the limit of {MAX_STEPS:,} "
                        f"steps a run (a measurement needs tens): give fewer")
    if warmup >= steps:
        raise UserError(f"--warmup {warmup} leaves none of the --steps {steps} to time (the first --warmup steps "
                        f"are left out of the median): give --steps above --warmup, e.g. --steps {warmup + 3}")
