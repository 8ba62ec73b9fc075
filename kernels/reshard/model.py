"""What the executor does, priced: a plan as the operations each rank's stream runs
(``kernels.reshard.program``: every rank posts the jobs' transfers in waves on one stream), simulated
with a cost per operation.

The planner's makespan charges each job its transfers under the network model; the executor
does more, and differently (4 x H200, 2026-11-28: measured 1.1 to 1.9x the makespan):
- ``pack``: the sender's slice is copied to a contiguous buffer when it is not contiguous in its tile
  (every job's, before the first wave); a job whose sender is its only receiver is one copy, and nothing else;
- send_recv: one point-to-point transfer of the unit per receiver other than the sender;
- local/global all-gather: the sender zero-fills a padded buffer (``part`` = n / g rounded up, g
  parts), copies the slice into it and sends each receiver its part; each receiver zero-fills its buffer
  and receives its part (the sender, when it receives, copies its own); in the second wave the group
  all-gathers g parts;
- broadcast: one broadcast of the unit over the chain (NCCL pipelines it itself: no partitions);
- ``place``: every receiver copies the unit into its destination tile, after the last wave, except where it
  received the unit itself (send_recv, broadcast; not the sender) into one contiguous run of that tile;
and every call ends with a synchronisation (what a call that moves nothing costs: ``empty``).
A wave (``Op.wave``) runs its copies and fills on their ranks' streams, then its transfers and collectives
together, as one group: they start when the ranks they wait for are free (a transfer's sender, a collective's
every rank), and end together, after the busiest rank's share: the longer of what it sends and what it receives
point to point (the two directions of a link run at once; one direction's transfers one after the other), and
its collectives one after the other.
The host walks the plan in Python besides (``host``: a dry run's time, the plan executed with transfers that
move nothing, less ``empty`` and its copies and fills on a backend whose operations block, MPI: there the call is
the host's walk, then the streams' operations). On a backend whose operations are asynchronous, NCCL, the host
queues them as it walks: the call is the walk up to its last group (the dry run less its busiest rank's places,
which it waits for), with the first wave's copies and fills under it, then the groups and the places on the
streams. The prediction adds ``empty``. The costs are a function of the operation (``Op``):
``kernels.reshard.harness`` measures each distinct operation of the plans alone, and each plan's dry run (and its
walk up to the synchronisation, recorded), in the same run (2 x H200, 2026-11-29: reports/records/collectives4.md,
sessions 24 and 25).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kernels.reshard.plan import Plan
from kernels.reshard.program import in_place
from kernels.reshard.spec import contiguous
from kernels.reshard.strategies import broadcast_chain

KINDS = ("p2p", "broadcast", "allgather", "copy", "fill")


@dataclass(frozen=True)
class Op:
    """One operation: ``kind`` (``KINDS``), the ranks whose streams it holds (p2p: sender, receiver;
    broadcast: the chain, sender first; allgather: the group), its bytes (allgather: the gathered
    buffer), for a broadcast the plan's partitions (the MPI backend pipelines by them), and its wave."""

    kind: str
    ranks: tuple[int, ...]
    nbytes: int
    partitions: int = 1
    wave: int = field(default=0, compare=False)  # the group it is posted in (``PLACE``: the places after them)

    @property
    def key(self) -> tuple:
        """What its cost depends on: copies and fills cost the same on every rank."""
        return (self.kind, self.nbytes) if self.kind in ("copy", "fill") else \
            (self.kind, self.ranks, self.nbytes, self.partitions)


def operations(plan: Plan) -> list[Op]:
    """Every operation of one call of ``plan``, in the order the ranks issue them (module doc)."""
    esize = np.dtype(plan.task.dtype).itemsize
    src, dst = plan.task.src_tiles(), plan.task.dst_tiles()
    out: list[Op] = []
    for job in plan.jobs:
        unit = plan.units[job.task]
        n = unit.nbytes
        s, recv = job.sender, tuple(job.receivers)
        if job.local:
            out.append(Op("copy", (s,), n))
            continue
        if not contiguous(unit.box, src[s]):
            out.append(Op("copy", (s,), n))
        if job.strategy == "send_recv":
            out += [Op("p2p", (s, d), n) for d in recv if d != s]
        elif job.strategy in ("local_allgather", "global_allgather"):
            group = tuple(sorted(recv))
            g = len(group)
            part = -(-(n // esize) // g) * esize
            out += [Op("fill", (s,), part * g), Op("copy", (s,), n)]
            out += [Op("fill", (d,), part * g) for d in group if d != s]
            out += [Op("p2p", (s, d), part) for d in group if d != s]
            if s in group:
                out += [Op("fill", (s,), part * g), Op("copy", (s,), part)]
            if g > 1:
                out.append(Op("allgather", group, part * g, wave=1))
        elif job.strategy == "broadcast":
            chain = tuple(broadcast_chain(plan.task.devices_per_host, s, recv))
            if len(chain) > 1:
                out.append(Op("broadcast", chain, n, job.partitions))
        out += [Op("copy", (d,), n, wave=PLACE) for d in recv if not in_place(job, unit.box, d, dst)]
    return out


PLACE = 2  # the places' wave: after the scatters and transfers (0) and the all-gathers (1)
LOCAL = ("copy", "fill")


def simulate(ops: list[Op], cost: Callable[[Op], float]) -> float:
    """The last stream's end, wave by wave (module doc): a wave's copies and fills on their ranks' streams, then
    its transfers and collectives as one group, which starts when the ranks it waits for are free (the senders of
    its transfers: a busy receiver does not hold its sender back; every rank of a collective), and ends after the
    busiest rank's point-to-point directions (each the sum of its transfers) and collectives, and not before any
    of its ranks is free."""
    free: dict[int, float] = {}
    for w in sorted({op.wave for op in ops}):
        wave = [op for op in ops if op.wave == w]
        for op in wave:
            if op.kind in LOCAL:
                free[op.ranks[0]] = free.get(op.ranks[0], 0.0) + cost(op)
        moves = [op for op in wave if op.kind not in LOCAL]
        ranks = {r for op in moves for r in op.ranks}
        if not ranks:
            continue
        waits = {r for op in moves for r in (op.ranks[:1] if op.kind == "p2p" else op.ranks)}

        def share(r: int) -> float:
            out, into = (sum(cost(op) for op in moves if op.kind == "p2p" and op.ranks[end] == r) for end in (0, 1))
            return max(out, into) + sum(cost(op) for op in moves if op.kind != "p2p" and r in op.ranks)
        start = max(free.get(r, 0.0) for r in waits)
        end = max([start + max(share(r) for r in ranks)] + [free.get(r, 0.0) for r in ranks])
        free.update(dict.fromkeys(ranks, end))
    return max(free.values(), default=0.0)


def host_time(plan: Plan, cost: Callable[[Op], float], empty: float, dry: float, asynchronous: bool = False) -> float:
    """The host's own time in one call, from the dry run's ``dry`` seconds less ``empty``. Operations that block
    (MPI) run inside the dry run one after the other, so its copies and fills (its operations simulated with the
    transfers free) come off it. Asynchronous ones (NCCL) are queued on the streams as the host walks: the dry run
    ends when its busiest rank's places are done, so those come off it; what is left is the walk up to the last
    group, the first wave's copies and fills run under it. Never below 0."""
    ops = operations(plan)
    if not asynchronous:
        return max(dry - simulate(ops, lambda op: cost(op) if op.kind in LOCAL else 0.0) - empty, 0.0)
    places = [op for op in ops if op.wave == PLACE]
    busiest = max((sum(cost(op) for op in places if op.ranks == (r,)) for r in {op.ranks[0] for op in places}),
                  default=0.0)
    return max(dry - empty - busiest, 0.0)


def predict(plan: Plan, cost: Callable[[Op], float], empty: float, host: float = 0.0,
            asynchronous: bool = False) -> float:
    """Seconds of one call of ``plan``: the ``host`` time, then its operations simulated (``simulate``), plus a
    call's ``empty``; asynchronous operations: the first wave's copies and fills under the host's walk, what its
    groups start after it (2 x H200, 2026-11-29, four shapes of 2 GPUs' tasks: 58 of 64 plans within 15%, where
    the groups posted at the walk up to the dry run's synchronisation gave 54; reports/records/collectives4.md,
    session 25)."""
    first = (lambda op: 0.0 if op.kind in LOCAL and op.wave == 0 else cost(op)) if asynchronous else cost
    return host + simulate(operations(plan), first) + empty


def measured_cost(times: dict[tuple, float], empty: float) -> Callable[[Op], float]:
    """Each operation's cost from the times of the operations measured alone (``Op.key`` -> seconds of a
    call that runs it and synchronises), less ``empty`` (the synchronisation a sequence pays once)."""
    def cost(op: Op) -> float:
        return max(times[op.key] - empty, 0.0)
    return cost
