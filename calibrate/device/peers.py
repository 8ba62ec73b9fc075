"""Processes of one NCCL group on this machine's first GPUs, spawned by ``torch.multiprocessing``: what
``calibrate compute`` and ``calibrate module`` measure among peers (compute's slowdown beside collectives:
``calibrate.overlap``; the host's cost of the paths whose collectives a group of one skips:
``calibrate.modulehost.peer_host``). Set up and torn down once here, NVLink multicast off, the communicators
destroyed on every rank (``run_peers``); or processes one on each GPU, no group, each with a share of independent
work (``run_each``: ``calibrate module``'s tensor widths). A job that fails, or that has not finished within its
limit (a hung group), ends the run with one line, its processes stopped."""
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
        try:
            join_within(context, limit_s, f"{what} ({world} processes, one NCCL group)")
        except UserError:
            errors = sorted(f for f in os.listdir(folder) if f.startswith("error-"))
            if not errors:
                raise
            with open(os.path.join(folder, errors[0])) as f:
                raise UserError(f"{what} failed on rank {errors[0][6:-4]}: {f.read()}") from None
        with open(os.path.join(folder, "result.json")) as f:
            return json.load(f)


def run_each(job, args: list[tuple], what: str, device_type: str = "cuda",
             limit_s: float = PEERS_LIMIT_S) -> list[dict]:
    """``job(torch, device, *args[i])`` (a module-level function) in process i of ``len(args)``, on GPU i (every
    process on the CPU where ``device_type`` is "cpu": tests), no process group; each process's result (a JSON-able
    dict), in order."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(_each_worker, args=(folder, job, args, device_type), nprocs=len(args),
                                     start_method="spawn", join=False)
        join_within(context, limit_s, f"{what} ({len(args)} processes)")
        out = []
        for i in range(len(args)):
            with open(os.path.join(folder, f"result-{i}.json")) as f:
                out.append(json.load(f))
        return out


def _each_worker(i: int, folder: str, job, args: list[tuple], device_type: str) -> None:
    import torch
    device = torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(i)
        device = torch.device("cuda", i)
    out = job(torch, device, *args[i])
    with open(os.path.join(folder, f"result-{i}.json"), "w") as f:
        json.dump(out, f)


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
    except Exception as e:  # its peers may wait in a collective it left, and an orderly destroy waits with them
        # (2 x H200, 2026-11-29): its error kept for the one line, the process ended at once, the group with it
        with open(os.path.join(folder, f"error-{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}".splitlines()[0][:300])
        os._exit(1)
    if rank == 0:
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
