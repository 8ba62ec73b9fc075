"""Processes of one NCCL group on this machine's first GPUs, spawned by ``torch.multiprocessing``: what
``calibrate compute`` and ``calibrate module`` measure among peers (compute's slowdown beside collectives:
``calibrate.overlap``; the host's cost of the paths whose collectives a group of one skips:
``calibrate.moduletime.peer_host``). Set up and torn down once here, NVLink multicast off, the communicators
destroyed on every rank. A job that fails, or that has not finished within its limit (a hung group), ends the
run with one line, its processes stopped."""
from __future__ import annotations

import json
import os
import tempfile
import time

from calibrate.errors import UserError

NO_MULTICAST = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))
PEERS_LIMIT_S = 420.0  # longer than any measurement here takes (the host's cost of an 8 B model's paths)


def run_peers(job, args: tuple = (), world: int = 2, what: str = "the measurement among GPUs",
              limit_s: float = PEERS_LIMIT_S) -> dict:
    """``job(torch, device, world, *args)`` (a module-level function: spawned processes import it) on each of
    ``world`` processes, one GPU and one NCCL group rank each; rank 0's result (a JSON-able dict)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(_worker, args=(world, folder, job, args), nprocs=world, start_method="spawn",
                                     join=False)
        join_within(context, limit_s, f"{what} ({world} processes, one NCCL group)")
        with open(os.path.join(folder, "result.json")) as f:
            return json.load(f)


def join_within(context, limit_s: float, what: str) -> None:
    """Wait for ``context``'s processes (``torch.multiprocessing.start_processes(..., join=False)``); one that failed,
    or any left after ``limit_s``, stops them all and ends the run with one line naming ``what``."""
    from torch.multiprocessing.spawn import ProcessException
    deadline = time.monotonic() + limit_s
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise UserError(f"{what} did not finish in {limit_s:.0f} s (a hung group?): check that the GPUs can "
                                f"form an NCCL group (nvidia-smi topo -m; NCCL_DEBUG=INFO), or measure without it "
                                f"(calibrate module --no-host; one GPU visible for calibrate compute)")
    except ProcessException as e:
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1:] or ["(no message)"]
        raise UserError(f"{what} failed: {last[0].strip()[:300]}") from None
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


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
