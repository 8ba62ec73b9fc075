"""Processes of one NCCL group on this machine's first GPUs, spawned by ``torch.multiprocessing``: what
``calibrate compute`` and ``calibrate module`` measure among peers (compute's slowdown beside collectives:
``calibrate.overlap``; the host's cost of the paths whose collectives a group of one skips:
``calibrate.moduletime.peer_host``). Set up and torn down once here, NVLink multicast off, the communicators
destroyed on every rank."""
from __future__ import annotations

import json
import os
import tempfile

NO_MULTICAST = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))


def run_peers(job, args: tuple = (), world: int = 2) -> dict:
    """``job(torch, device, world, *args)`` (a module-level function: spawned processes import it) on each of
    ``world`` processes, one GPU and one NCCL group rank each; rank 0's result (a JSON-able dict)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_worker, args=(world, folder, job, args), nprocs=world, start_method="spawn")
        with open(os.path.join(folder, "result.json")) as f:
            return json.load(f)


def _worker(rank: int, world: int, folder: str, job, args: tuple) -> None:
    for k, v in NO_MULTICAST:
        os.environ[k] = v
    import torch
    dist = torch.distributed
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(folder, "store"), world), rank=rank,
                            world_size=world, device_id=device)
    try:
        out = job(torch, device, world, *args)
        if rank == 0:
            with open(os.path.join(folder, "result.json"), "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()
