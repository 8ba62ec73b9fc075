"""Running a resharding plan on one rank: every strategy written once over the
primitives of a backend (send, recv, ring broadcast, all-gather), strategies
(``kernels.reshard.strategies``) and backends behind registries.

All ranks walk the plan's jobs in the same order and take part in the jobs that
name them, so the earliest unfinished job always has all its participants: the
execution cannot deadlock. Each job uses its position in the plan as its tag.
"""
from __future__ import annotations

import numpy as np

from calibrate.errors import UserError
from calibrate.registry import Registry
from kernels.reshard.plan import Plan, PlannedJob
from kernels.reshard.spec import Box, local_slices
from kernels.reshard.strategies import STRATEGIES, Move

# imported lazily so that the NCCL backend needs cupy only when used
BACKENDS = Registry("backend", {
    "mpi": "kernels.reshard.mpi_backend:MPIBackend",
    "nccl": "kernels.reshard.nccl_backend:NCCLBackend",
})


class Backend:
    """Primitives on flat contiguous buffers of one dtype; ``device`` is this rank's device id."""

    device: int
    xp = np  # the array module of the buffers
    asynchronous = False  # operations queued on a stream (the host goes on) rather than done when called

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

    def exchange(self, sends: list, recvs: list) -> None:
        """Post every (buffer, peer) send and receive at once and complete them (a plain all-to-all of
        tiles); between two ranks, sends and receives match in the order given."""
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the backend's resources; collective: every rank calls it together."""


def _flat(xp, tile, box: Box, origin: Box):
    return xp.ascontiguousarray(tile[local_slices(box, origin)]).reshape(-1)


def _place(tile, box: Box, origin: Box, flat, n: int) -> None:
    shape = tuple(hi - lo for lo, hi in box)
    tile[local_slices(box, origin)] = flat[:n].reshape(shape)


def run_job(plan: Plan, job: PlannedJob, tag: int, be: Backend, src_tile, dst_tile) -> None:
    me = be.device
    if me != job.sender and me not in job.receivers:
        return
    run = STRATEGIES.get(job.strategy)
    if run is None:
        raise UserError(f"plan job uses unknown strategy {job.strategy!r}: re-plan with python -m autotune reshard")
    unit = plan.units[job.task]
    n = int(np.prod([hi - lo for lo, hi in unit.box]))
    data = _flat(be.xp, src_tile, unit.box, plan.task.src_tiles().get(me)) if me == job.sender else None
    buf = run(Move(be, job.sender, job.receivers, job.partitions, plan.task.devices_per_host, data, n,
                   np.dtype(plan.task.dtype), tag))
    if me in job.receivers:
        _place(dst_tile, unit.box, plan.task.dst_tiles().get(me), buf, n)


def execute(plan: Plan, be: Backend, src_tile, dst_tile) -> None:
    """Run every job of the plan that involves this rank; ``dst_tile`` is filled in place."""
    be.prepare(plan)
    for tag, job in enumerate(plan.jobs):
        run_job(plan, job, tag % 32000, be, src_tile, dst_tile)
    be.synchronize()
