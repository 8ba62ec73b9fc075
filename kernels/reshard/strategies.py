"""How each strategy of a plan job runs on one rank, behind one registry
(``STRATEGIES``: the names a plan's jobs use; the planner's cost models in
``autotune.reshard.strategies`` carry the same names).

A strategy is a generator over the job's context (``Move``): each step posts one wave of its transfers
(``kernels.reshard.program.execute`` posts every job's wave in one group) and yields; after its last it
returns the flat buffer of the unit's elements on a receiver (None elsewhere). The buffers it posted stay
alive in it until then:
- send_recv: the sender sends the whole slice to each receiver;
- local_allgather / global_allgather: the sender scatters 1/len(receivers) of the
  slice to each receiver (the first wave), which all-gather it (the second);
- broadcast: a ring broadcast from the sender along ``broadcast_chain``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def broadcast_chain(devices_per_host: int, sender: int, receivers) -> list[int]:
    """Sender first, then the receivers on its host, then the other hosts in order."""
    def host(d):
        return d // devices_per_host
    rest = sorted((d for d in receivers if d != sender), key=lambda d: (host(d) != host(sender), host(d), d))
    return [sender] + rest


@dataclass(frozen=True)
class Move:
    """One job as one rank sees it."""

    backend: object          # kernels.reshard.program.Backend
    sender: int
    receivers: tuple[int, ...]
    partitions: int
    devices_per_host: int
    data: object             # the sender's flat slice, None on other ranks
    n: int                   # elements of the unit
    dtype: np.dtype
    tag: int
    out: object = None       # where a receiver takes the unit (a view of its destination tile), None: a new buffer

    @property
    def me(self) -> int:
        return self.backend.device

    def received(self):
        """The buffer this rank ends with: the sender's slice, or the receiver's ``out`` or a new buffer."""
        if self.me == self.sender:
            return self.data
        return self.backend.xp.empty(self.n, self.dtype) if self.out is None else self.out


def send_recv(m: Move):
    be = m.backend
    if m.me == m.sender:
        for d in m.receivers:
            if d != m.me:
                be.send(m.data, d, m.tag)
    buf = m.received()
    if m.me in m.receivers and m.me != m.sender:
        be.recv(buf, m.sender, m.tag)
    yield
    return buf


def allgather(m: Move):
    be, xp = m.backend, m.backend.xp
    group = tuple(sorted(m.receivers))
    part = -(-m.n // len(group))
    padded = None
    if m.me == m.sender:
        padded = xp.zeros(part * len(group), m.dtype)
        padded[:m.n] = m.data
        for i, d in enumerate(group):
            if d != m.me:
                be.send(padded[i * part:(i + 1) * part], d, m.tag)
    buf = None
    if m.me in m.receivers:
        i = group.index(m.me)
        buf = xp.zeros(part * len(group), m.dtype)
        if m.me == m.sender:
            buf[i * part:(i + 1) * part] = padded[i * part:(i + 1) * part]
        else:
            be.recv(buf[i * part:(i + 1) * part], m.sender, m.tag)
    yield
    if buf is not None:
        be.allgather(buf, group, part, m.tag)
        yield
    return buf


def broadcast(m: Move):
    chain = tuple(broadcast_chain(m.devices_per_host, m.sender, m.receivers))
    buf = m.received()
    m.backend.ring_broadcast(buf, chain, m.partitions, m.tag)
    yield
    return buf


# the strategies whose receivers take the unit itself, not a padded buffer: received into ``Move.out``
RECEIVE_DIRECT = ("send_recv", "broadcast")
STRATEGIES = {
    "send_recv": send_recv,
    "local_allgather": allgather,
    "global_allgather": allgather,
    "broadcast": broadcast,
}


def groups(plan) -> set[tuple[int, ...]]:
    """The device groups that the plan's collective jobs run on (broadcast chains, all-gather groups)."""
    out = set()
    for job in plan.jobs:
        if job.strategy == "broadcast":
            out.add(tuple(broadcast_chain(plan.task.devices_per_host, job.sender, job.receivers)))
        elif job.strategy in ("local_allgather", "global_allgather"):
            out.add(tuple(sorted(job.receivers)))
    return out
