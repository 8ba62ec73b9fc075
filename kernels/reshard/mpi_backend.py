"""The MPI backend: host (numpy) buffers, point-to-point MPI between ranks.

Device ids of the plan map to ranks through ``ranks`` (default: device id = rank). Inside a group
(``group``) sends and receives are non-blocking, completed when it closes. The ring broadcast forwards each
of its K partitions as soon as it has arrived (non-blocking sends), so the partitions pipeline down the
chain; the all-gather is a ring of Sendrecv steps.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from kernels.reshard.program import Backend


class MPIBackend(Backend):
    xp = np

    def __init__(self, comm=None, ranks: dict[int, int] | None = None, device: int | None = None):
        self.comm = comm or MPI.COMM_WORLD
        self.ranks = ranks
        self.device = self.comm.Get_rank() if device is None else device
        self._posted: list | None = None  # the open group's requests (``group``); None: blocking calls

    def rank(self, device: int) -> int:
        return device if self.ranks is None else self.ranks[device]

    def send(self, buf, peer, tag):
        if self._posted is None:
            self.comm.Send(buf, dest=self.rank(peer), tag=tag)
        else:
            self._posted.append(self.comm.Isend(buf, dest=self.rank(peer), tag=tag))

    def recv(self, buf, peer, tag):
        if self._posted is None:
            self.comm.Recv(buf, source=self.rank(peer), tag=tag)
        else:
            self._posted.append(self.comm.Irecv(buf, source=self.rank(peer), tag=tag))

    def ring_broadcast(self, buf, chain, partitions, tag):
        i = chain.index(self.device)
        bounds = np.linspace(0, buf.size, max(partitions, 1) + 1).astype(int)
        parts = [buf[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
        nxt = self.rank(chain[i + 1]) if i + 1 < len(chain) else None
        reqs = []
        for p in parts:
            if i > 0:
                self.comm.Recv(p, source=self.rank(chain[i - 1]), tag=tag)
            if nxt is not None:
                reqs.append(self.comm.Isend(p, dest=nxt, tag=tag))
        MPI.Request.Waitall(reqs)

    def allgather(self, buf, group, part, tag):
        b = len(group)
        if b < 2:
            return
        i = group.index(self.device)
        nxt, prev = self.rank(group[(i + 1) % b]), self.rank(group[(i - 1) % b])
        for step in range(b - 1):
            s, r = (i - step) % b, (i - step - 1) % b
            self.comm.Sendrecv(buf[s * part:(s + 1) * part], dest=nxt, sendtag=tag,
                               recvbuf=buf[r * part:(r + 1) * part], source=prev, recvtag=tag)

    @contextmanager
    def group(self):
        """Sends and receives inside it are non-blocking, completed together when it closes."""
        self._posted = []
        try:
            yield
            MPI.Request.Waitall(self._posted)
        finally:
            self._posted = None

    def synchronize(self):
        self.comm.Barrier()
