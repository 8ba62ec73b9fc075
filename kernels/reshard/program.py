"""Running a resharding plan on one rank: every strategy written once over the
primitives of a backend (send, recv, ring broadcast, all-gather), strategies
(``kernels.reshard.strategies``) and backends behind registries.

The jobs of a plan are independent (each moves its own unit from the source tiles), so they go in waves:
every job's first transfers are posted in one group (``Backend.group``: one NCCL group, or MPI's non-blocking
calls completed together), then the transfers that need those done (an all-gather after its scatter) in a second,
then every receiver places its units (a unit that is one contiguous run of the destination tile is received straight
into it, and a job whose sender is its only receiver is one copy). All ranks walk the jobs in the same order and take part in the jobs that
name them, so the transfers of a wave match on every rank. Each job uses its position in the plan as its tag.
(2 x H200, 2026-11-29: walked job by job, each transfer alone, the 2 -> 2 transposed task took 1.20-1.39x a plain
exchange of its tiles; reports/records/collectives4.md, session 24.)
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from calibrate.errors import UserError
from calibrate.registry import Registry
from kernels.reshard.plan import Plan, PlannedJob
from kernels.reshard.spec import box_volume, contiguous, local_slices
from kernels.reshard.strategies import RECEIVE_DIRECT, STRATEGIES, Move

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


@dataclass(frozen=True)
class Leg:
    """One job of a plan as one rank runs it, worked out once (``legs``)."""

    job: PlannedJob
    tag: int
    n: int                              # elements of the unit
    src: tuple[slice, ...] | None       # the unit in this rank's source tile (its sender)
    dst: tuple[slice, ...] | None       # the unit in this rank's destination tile (a receiver)
    direct: bool                        # received straight into the destination tile (``in_place``)


def in_place(job: PlannedJob, box, rank: int, dst: dict) -> bool:
    """Whether ``rank`` receives ``job``'s unit (``box``) straight into its destination tile (``dst[rank]``): a
    receiver other than the sender, a strategy whose receivers take the unit itself, one contiguous run of the
    tile. Elsewhere a receiver places the unit after the last wave."""
    return (rank in job.receivers and rank != job.sender and job.strategy in RECEIVE_DIRECT
            and contiguous(box, dst[rank]))


def legs(plan: Plan, me: int) -> list[Leg]:
    """The jobs of ``plan`` that involve rank ``me``, in plan order, as it runs them; an unknown strategy is
    refused before anything moves."""
    src, dst = plan.task.src_tiles(), plan.task.dst_tiles()
    out = []
    for tag, job in enumerate(plan.jobs):
        if job.strategy not in STRATEGIES:
            raise UserError(f"plan job uses unknown strategy {job.strategy!r}: re-plan with python -m autotune "
                            f"reshard")
        if me != job.sender and me not in job.receivers:
            continue
        box = plan.units[job.task].box
        into = me in job.receivers
        out.append(Leg(job, tag % 32000, box_volume(box), local_slices(box, src[me]) if me == job.sender else None,
                       local_slices(box, dst[me]) if into else None, in_place(job, box, me, dst)))
    return out


def execute(plan: Plan, be: Backend, src_tile, dst_tile, mine: list[Leg] | None = None) -> None:
    """Run every job of the plan that involves this rank, in waves (module doc); ``dst_tile`` is filled in place.
    ``mine``: its ``legs``, with ``be`` prepared for the plan (``Backend.prepare``), both done once by a caller that
    runs the plan again and again; else both are done here. A job's generator holds the buffers it posted until it
    ends (MPI's non-blocking sends read them)."""
    if mine is None:
        be.prepare(plan)
        mine = legs(plan, be.device)
    xp, dtype = be.xp, np.dtype(plan.task.dtype)
    direct = dst_tile is not None and dst_tile.flags.c_contiguous
    live, done = [], []
    for leg in mine:
        if leg.job.local:
            dst_tile[leg.dst] = src_tile[leg.src]
            continue
        job = leg.job
        data = None if leg.src is None else xp.ascontiguousarray(src_tile[leg.src]).reshape(-1)
        out = dst_tile[leg.dst].reshape(-1) if leg.direct and direct else None
        live.append((leg, out, STRATEGIES[job.strategy](Move(be, job.sender, job.receivers, job.partitions,
                                                             plan.task.devices_per_host, data, leg.n, dtype,
                                                             leg.tag, out))))
    while live:
        going = []
        with be.group():
            for leg, out, walk in live:
                try:
                    next(walk)
                    going.append((leg, out, walk))
                except StopIteration as end:
                    done.append((leg, out, end.value))
        live = going
    for leg, out, buf in done:
        if leg.dst is not None and buf is not out:
            dst_tile[leg.dst] = buf[:leg.n].reshape(dst_tile[leg.dst].shape)
    be.synchronize()
