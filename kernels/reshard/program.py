"""Running a resharding plan on one rank: every strategy written once over the
primitives of a backend (send, recv, ring broadcast, all-gather), strategies
(``kernels.reshard.strategies``) and backends behind registries.

The jobs of a plan are independent (each moves its own unit from the source tiles), so they go in waves:
every job's first transfers are posted in one group (``Backend.group``: one NCCL group, or MPI's non-blocking
calls completed together), then the transfers that need those done (an all-gather after its scatter) in a second,
then every receiver places its units. All ranks walk the jobs in the same order and take part in the jobs that
name them, so the transfers of a wave match on every rank. Each job uses its position in the plan as its tag.
(2 x H200, 2026-11-29: walked job by job, each transfer alone, the 2 -> 2 transposed task took 1.20-1.39x a plain
exchange of its tiles; reports/records/collectives4.md, session 24.)
"""
from __future__ import annotations

from contextlib import nullcontext

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


EXCHANGE_TAG = 32001  # a plan's jobs take tags below 32000


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
        """Post every (buffer, peer) send and receive in one group (a plain all-to-all of tiles); between two
        ranks, sends and receives match in the order given."""
        with self.group():
            for buf, peer in sends:
                self.send(buf, peer, EXCHANGE_TAG)
            for buf, peer in recvs:
                self.recv(buf, peer, EXCHANGE_TAG)

    def group(self):
        """A context whose transfers are posted together and complete (on an asynchronous backend: are queued)
        when it closes; every rank opens and closes it at the same points of the plan."""
        return nullcontext()

    def synchronize(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the backend's resources; collective: every rank calls it together."""


def _flat(xp, tile, box: Box, origin: Box):
    return xp.ascontiguousarray(tile[local_slices(box, origin)]).reshape(-1)


def _place(tile, box: Box, origin: Box, flat, n: int) -> None:
    shape = tuple(hi - lo for lo, hi in box)
    tile[local_slices(box, origin)] = flat[:n].reshape(shape)


def _walk(plan: Plan, job: PlannedJob, tag: int, be: Backend, src_tile):
    """The job's strategy on this rank (``kernels.reshard.strategies``: a generator, one wave a step)."""
    run = STRATEGIES.get(job.strategy)
    if run is None:
        raise UserError(f"plan job uses unknown strategy {job.strategy!r}: re-plan with python -m autotune reshard")
    me = be.device
    unit = plan.units[job.task]
    data = _flat(be.xp, src_tile, unit.box, plan.task.src_tiles().get(me)) if me == job.sender else None
    return run(Move(be, job.sender, job.receivers, job.partitions, plan.task.devices_per_host, data,
                    _size(unit.box), np.dtype(plan.task.dtype), tag))


def _size(box: Box) -> int:
    return int(np.prod([hi - lo for lo, hi in box]))


def execute(plan: Plan, be: Backend, src_tile, dst_tile) -> None:
    """Run every job of the plan that involves this rank, in waves (module doc); ``dst_tile`` is filled in
    place. A job's generator holds the buffers it posted until it ends (MPI's non-blocking sends read them)."""
    be.prepare(plan)
    me = be.device
    live = [(job, _walk(plan, job, tag % 32000, be, src_tile)) for tag, job in enumerate(plan.jobs)
            if me == job.sender or me in job.receivers]
    done = []
    while live:
        going = []
        with be.group():
            for job, walk in live:
                try:
                    next(walk)
                    going.append((job, walk))
                except StopIteration as end:
                    done.append((job, end.value))
        live = going
    for job, buf in done:
        if me in job.receivers:
            unit = plan.units[job.task]
            _place(dst_tile, unit.box, plan.task.dst_tiles().get(me), buf, _size(unit.box))
    be.synchronize()
