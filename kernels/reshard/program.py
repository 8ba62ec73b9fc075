"""Running a resharding plan on one rank: every strategy written once over the
primitives of a backend (send, recv, ring broadcast, all-gather), backends
behind a registry.

All ranks walk the plan's jobs in the same order and take part in the jobs that
name them, so the earliest unfinished job always has all its participants: the
execution cannot deadlock. Each job uses its position in the plan as its tag.
"""
from __future__ import annotations

import numpy as np

from autotune.reshard.plan import Plan, PlannedJob
from autotune.reshard.spec import Box, local_slices
from autotune.reshard.strategies import broadcast_chain
from calibrate.errors import UserError
from calibrate.registry import Registry

# imported lazily so that the NCCL backend needs cupy only when used
BACKENDS = Registry("backend", {
    "mpi": "kernels.reshard.mpi_backend:MPIBackend",
    "nccl": "kernels.reshard.nccl_backend:NCCLBackend",
})


class Backend:
    """Primitives on flat contiguous buffers of one dtype; ``device`` is this rank's device id."""

    device: int
    xp = np  # the array module of the buffers

    def prepare(self, plan: Plan) -> None:
        """Set up whatever the plan's jobs need (e.g. communicators)."""

    def send(self, buf, peer: int, tag: int) -> None:
        raise NotImplementedError

    def recv(self, buf, peer: int, tag: int) -> None:
        raise NotImplementedError

    def ring_broadcast(self, buf, chain: tuple[int, ...], partitions: int, tag: int) -> None:
        raise NotImplementedError

    def allgather(self, buf, group: tuple[int, ...], part: int, tag: int) -> None:
        """``buf`` holds len(group)*part elements; block i comes from group[i]."""
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError


def _flat(xp, tile, box: Box, origin: Box):
    return xp.ascontiguousarray(tile[local_slices(box, origin)]).reshape(-1)


def _place(tile, box: Box, origin: Box, flat, n: int) -> None:
    shape = tuple(hi - lo for lo, hi in box)
    tile[local_slices(box, origin)] = flat[:n].reshape(shape)


def run_job(plan: Plan, job: PlannedJob, tag: int, be: Backend, src_tile, dst_tile) -> None:
    me = be.device
    if me != job.sender and me not in job.receivers:
        return
    xp = be.xp
    unit = plan.units[job.task]
    src_box = plan.task.src_tiles().get(me)
    dst_box = plan.task.dst_tiles().get(me)
    n = int(np.prod([hi - lo for lo, hi in unit.box]))
    dtype = np.dtype(plan.task.dtype)
    data = _flat(xp, src_tile, unit.box, src_box) if me == job.sender else None
    receiving = me in job.receivers

    if job.strategy == "send_recv":
        if me == job.sender:
            for d in job.receivers:
                if d != me:
                    be.send(data, d, tag)
        buf = data if me == job.sender else xp.empty(n, dtype)
        if receiving and me != job.sender:
            be.recv(buf, job.sender, tag)
    elif job.strategy in ("local_allgather", "global_allgather"):
        group = tuple(sorted(job.receivers))
        part = -(-n // len(group))
        if me == job.sender:
            padded = xp.zeros(part * len(group), dtype)
            padded[:n] = data
            for i, d in enumerate(group):
                if d != me:
                    be.send(padded[i * part:(i + 1) * part], d, tag)
        buf = None
        if receiving:
            i = group.index(me)
            buf = xp.zeros(part * len(group), dtype)
            if me == job.sender:
                buf[i * part:(i + 1) * part] = padded[i * part:(i + 1) * part]
            else:
                be.recv(buf[i * part:(i + 1) * part], job.sender, tag)
            be.allgather(buf, group, part, tag)
    elif job.strategy == "broadcast":
        chain = tuple(broadcast_chain(plan.task.devices_per_host, job.sender, job.receivers))
        buf = data if me == job.sender else xp.empty(n, dtype)
        be.ring_broadcast(buf, chain, job.partitions, tag)
    else:
        raise UserError(f"plan job uses unknown strategy {job.strategy!r}: re-plan with python -m autotune reshard")
    if receiving:
        _place(dst_tile, unit.box, dst_box, buf, n)


def execute(plan: Plan, be: Backend, src_tile, dst_tile) -> None:
    """Run every job of the plan that involves this rank; ``dst_tile`` is filled in place."""
    be.prepare(plan)
    for tag, job in enumerate(plan.jobs):
        run_job(plan, job, tag % 32000, be, src_tile, dst_tile)
    be.synchronize()
