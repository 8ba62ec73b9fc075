"""The GPU of this rank: one process per GPU, chosen from the node-local rank."""
from __future__ import annotations

import socket

from calibrate.errors import UserError


def cupy_or_error(needs: str):
    """The cupy module, or one ``UserError`` saying that ``needs`` (e.g. "the nccl backend") needs it."""
    try:
        import cupy
    except ImportError:
        raise UserError(f"{needs} needs cupy with NCCL (pip install -e '.[gpu]') and a GPU") from None
    return cupy


def select_gpu(world, needs: str = "the nccl backend",
               fallback: str = "use --backend mpi") -> int:
    """Pick this rank's GPU from its node-local rank and make it current; refuse two ranks on one GPU.

    Collective over ``world`` (an mpi4py communicator): every rank raises the same
    error when any rank has a problem. Returns the device index.
    """
    from mpi4py import MPI

    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    try:
        import cupy as cp
    except ImportError:
        cp = None
    problem, device = "", -1
    try:
        ndev = cp.cuda.runtime.getDeviceCount() if cp is not None else 0
    except Exception:  # noqa: BLE001  (no driver, no device: reported below)
        ndev = 0
    if cp is None:
        problem = f"{needs} needs cupy (pip install -e '.[gpu]'); {fallback} on machines without GPUs"
    elif ndev == 0:
        problem = f"no GPU is visible on {socket.gethostname()}: {fallback}, or run on GPU nodes"
    elif ndev >= local_size:
        device = local_rank
    elif ndev == 1:
        device = 0  # one GPU visible per rank (e.g. Slurm --gpus-per-task): checked below
    else:
        problem = (f"{local_size} ranks on {socket.gethostname()} but only {ndev} GPUs: "
                   f"start one rank per GPU (--ntasks-per-node={ndev})")
    problems = [m for m in world.allgather(problem) if m]
    if problems:
        raise UserError(problems[0])
    cp.cuda.Device(device).use()
    bus = cp.cuda.runtime.deviceGetPCIBusId(device)
    ids = world.allgather((socket.gethostname(), bus))
    if len(set(ids)) != len(ids):
        raise UserError(
            "two ranks landed on the same GPU: start one rank per GPU "
            "(--ntasks-per-node equal to the GPUs per node, and --gpus-per-task=1 or none)"
        )
    return device


def device_name(cp, device: int) -> str:
    name = cp.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else name


def mpi_gpu(needs: str):
    """(MPI world, cupy, this rank's GPU) for a command run under mpirun, one process per GPU;
    one ``UserError`` naming ``needs`` ("the benchmark") where mpi4py, cupy or a GPU is missing."""
    try:
        from mpi4py import MPI
        import cupy
    except ImportError as e:
        raise UserError(f"{needs} needs cupy and mpi4py on a GPU machine ({e}); run it there under "
                        f"mpirun -np 2") from None
    world = MPI.COMM_WORLD
    return world, cupy, select_gpu(world, needs=needs, fallback="run it on a GPU machine")
