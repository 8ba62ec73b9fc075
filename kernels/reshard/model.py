"""What the executor does, priced: a plan as the operations each rank's stream runs
(``kernels.reshard.program``: every rank walks the jobs in plan order on one stream), simulated
with a cost per operation.

The planner's makespan charges each job its transfers under the network model; the executor
does more, and differently (4 x H200, 2026-11-28: measured 1.1 to 1.9x the makespan):
- ``pack``: the sender's slice is copied to a contiguous buffer when it is not contiguous in its tile;
- send_recv: one point-to-point transfer of the unit per receiver other than the sender, one after
  the other on the sender's stream (a transfer starts when both ends are free);
- local/global all-gather: the sender zero-fills a padded buffer (``part`` = n / g rounded up, g
  parts), copies the slice into it and sends each receiver its part in turn; each receiver
  zero-fills its buffer and receives its part (the sender, when it receives, copies its own), then
  the group all-gathers g parts;
- broadcast: one broadcast of the unit over the chain (NCCL pipelines it itself: no partitions);
- ``place``: every receiver copies the unit into its destination tile;
and every call ends with a synchronisation (what a call that moves nothing costs: ``empty``).
A transfer or collective starts when the streams of all its ranks are free and holds them for its
cost; a copy or fill holds its own rank's stream. The host walks the plan in Python besides
(``host``: a dry run's time, the plan executed with transfers that move nothing, less its copies and
fills and ``empty``; on a backend whose operations are asynchronous, NCCL, the host queues them on the
stream: the dry run less ``empty``, its copies and fills hidden under the walk, plus what issuing each
transfer and collective costs the host, ``launch``): there the call takes the longer of the streams and
the host, on a synchronous one (MPI) both one after the other. The prediction adds ``empty``. The costs
are a function of the operation (``Op``): ``kernels.reshard.harness`` measures each distinct operation of
the plans alone and back to back, and each plan's dry run, in the same run (2 x H200, 2026-11-29, three
shapes: reports/records/collectives4.md, session 24).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kernels.reshard.plan import Plan
from kernels.reshard.spec import Box
from kernels.reshard.strategies import broadcast_chain

KINDS = ("p2p", "broadcast", "allgather", "copy", "fill")


@dataclass(frozen=True)
class Op:
    """One operation: ``kind`` (``KINDS``), the ranks whose streams it holds (p2p: sender, receiver;
    broadcast: the chain, sender first; allgather: the group), its bytes (allgather: the gathered
    buffer) and, for a broadcast, the plan's partitions (the MPI backend pipelines by them)."""

    kind: str
    ranks: tuple[int, ...]
    nbytes: int
    partitions: int = 1

    @property
    def key(self) -> tuple:
        """What its cost depends on: copies and fills cost the same on every rank."""
        return (self.kind, self.nbytes) if self.kind in ("copy", "fill") else \
            (self.kind, self.ranks, self.nbytes, self.partitions)


def contiguous(box: Box, origin: Box) -> bool:
    """Whether ``box`` is one contiguous run of the C-ordered tile that holds ``origin``: every dimension
    after the last partial one full, every one before it of extent 1."""
    ext = [hi - lo for lo, hi in box]
    full = [hi - lo for lo, hi in origin]
    partial = [i for i, (e, f) in enumerate(zip(ext, full)) if e != f]
    return not partial or all(e == 1 for e in ext[:partial[-1]])


def operations(plan: Plan) -> list[Op]:
    """Every operation of one call of ``plan``, in the order the ranks issue them (module doc)."""
    esize = np.dtype(plan.task.dtype).itemsize
    src = plan.task.src_tiles()
    out: list[Op] = []
    for job in plan.jobs:
        unit = plan.units[job.task]
        n = unit.nbytes
        s, recv = job.sender, tuple(job.receivers)
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
                out.append(Op("allgather", group, part * g))
        elif job.strategy == "broadcast":
            chain = tuple(broadcast_chain(plan.task.devices_per_host, s, recv))
            if len(chain) > 1:
                out.append(Op("broadcast", chain, n, job.partitions))
        out += [Op("copy", (d,), n) for d in recv]
    return out


def simulate(ops: list[Op], cost: Callable[[Op], float]) -> float:
    """The last stream's end: each operation starts when all its ranks' streams are free."""
    free: dict[int, float] = {}
    for op in ops:
        end = max(free.get(r, 0.0) for r in op.ranks) + cost(op)
        for r in op.ranks:
            free[r] = end
    return max(free.values(), default=0.0)


LOCAL = ("copy", "fill")


def host_time(plan: Plan, cost: Callable[[Op], float], empty: float, dry: float,
              launch: Callable[[Op], float] | None = None) -> float:
    """The host's own time in one call, from the dry run's ``dry`` seconds less ``empty``. Operations that block
    (``launch`` None: MPI) run inside the dry run one after the other, so its copies and fills (its operations
    simulated with the transfers free) come off it. Asynchronous ones (NCCL) run on the streams while the host
    walks on, so the walk keeps its copies and fills and adds, on its busiest rank, each of that rank's transfers'
    and collectives' ``launch`` (what issuing it costs the host: ``launch_cost``). Never below 0."""
    if launch is None:
        local = simulate(operations(plan), lambda op: cost(op) if op.kind in LOCAL else 0.0)
        return max(dry - local - empty, 0.0)
    ops = [op for op in operations(plan) if op.kind not in LOCAL]
    issued = max((sum(launch(op) for op in ops if r in op.ranks) for r in {r for op in ops for r in op.ranks}),
                 default=0.0)
    return max(dry - empty, 0.0) + issued


def predict(plan: Plan, cost: Callable[[Op], float], empty: float, host: float = 0.0,
            overlaps: bool = False) -> float:
    """Seconds of one call of ``plan``: its operations simulated (``simulate``), with the ``host`` time
    overlapping them (``overlaps``: asynchronous operations) or after them, plus a call's ``empty``."""
    streams = simulate(operations(plan), cost)
    return (max(streams, host) if overlaps else streams + host) + empty


def measured_cost(times: dict[tuple, float], empty: float) -> Callable[[Op], float]:
    """Each operation's cost from the times of the operations measured alone (``Op.key`` -> seconds of a
    call that runs it and synchronises), less ``empty`` (the synchronisation a sequence pays once)."""
    def cost(op: Op) -> float:
        return max(times[op.key] - empty, 0.0)
    return cost


def launch_cost(times: dict[tuple, float], back_to_back: dict[tuple, float], repeat: int,
                empty: float) -> Callable[[Op], float]:
    """What issuing each operation costs the host beyond what the stream runs: its cost alone (``measured_cost``)
    less what each of ``repeat`` back to back adds (``back_to_back``: a call that runs it ``repeat`` times; the
    launch and the peers' meeting of each but the first hidden behind the one before)."""
    def cost(op: Op) -> float:
        return max(times[op.key] - empty - (back_to_back[op.key] - times[op.key]) / (repeat - 1), 0.0)
    return cost
