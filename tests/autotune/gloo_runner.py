"""One launcher for the multi-process tests: ``world`` CPU processes of this host on torch's gloo backend, each
rank running the same jobs (each under its planted bug where it names one), what every rank returned brought
back, the process group destroyed, and a hung run ended as a failure instead of hanging the suite."""
from __future__ import annotations

import contextlib
import datetime
import os
import random
import socket
import tempfile
import time

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A port of this host nobody listens on, below the kernel's ephemeral range. A port ``bind(0)`` hands out is of
    that range, where any outgoing connection (gloo's own pairs among them) may take it before rank 0 listens on
    it: CI failed so (EADDRINUSE, 2026-11-30). Below the range only a listener takes a port; where the range starts
    too low to leave one, ``bind(0)``'s."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    start, draw = max(1024, low - 16384), random.Random()
    for port in [draw.randrange(start, low) for _ in range(200)] if start < low else []:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_gloo(fn, jobs, world: int = 4, *, bugs: dict | None = None, timeout: float | None = None,
                limit: float = 600, init: bool = True) -> list[list]:
    """``fn(*job)`` for each of ``jobs`` on each of ``world`` forked ranks (this process's imports shared: spawning
    re-imports transformers on every rank): [rank][job] what it returned, or its exception as one line
    ("Type: message": a wrong plan may fail outright instead of giving other numbers).

    ``bugs``: each job's last item names its planted bug (None: none), a key of ``bugs`` whose value gives the
    context manager the job runs in (``fn`` takes the items before it). ``timeout``: gloo's for each collective,
    in seconds (None: torch's): a job that fails on some ranks leaves the others waiting on theirs. ``limit``:
    seconds for the whole run, after which the ranks are killed and a ``TimeoutError`` names those still running.
    ``init``: False where the job joins the group itself from torchrun's environment (a command's ``main``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        ctx = mp.start_processes(_rank, args=(world, free_port(), out, fn, jobs, bugs, timeout, init), nprocs=world,
                                 start_method="fork", join=False)
        deadline = time.monotonic() + limit
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0)):
            if time.monotonic() >= deadline:
                running = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                for p in ctx.processes:
                    p.kill()
                    p.join()
                raise TimeoutError(f"{fn.__name__} on {world} gloo ranks: ranks {running} still "
                                   f"running after {limit:g} s (a collective some rank never reached?), killed")
        return [torch.load(f"{out}.{r}") for r in range(world)]


def _rank(rank, world, port, out, fn, jobs, bugs, timeout, init):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=None if timeout is None else datetime.timedelta(seconds=timeout))
        results = []
        for job in jobs:
            args, bug = (job[:-1], job[-1]) if bugs else (job, None)
            try:
                with bugs[bug]() if bug else contextlib.nullcontext():
                    results.append(fn(*args))
            except Exception as e:
                results.append(f"{type(e).__name__}: {e}")
        torch.save(results, f"{out}.{rank}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
