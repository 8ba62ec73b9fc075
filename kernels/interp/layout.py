"""Where the transport lives in each rank's connection pool.

Every rank allocates one pool of the same layout and maps every other rank's pool
through a CUDA IPC handle. A connection (sender, receiver, channel, slice) has,
per protocol:
  in the receiver's pool: its FIFO (slots x slot_bytes), its ``tail`` word
      (Simple; released by the sender) and the receiver's sequence counter;
  in the sender's pool: its ``head`` word (released by the receiver) and the
      sender's sequence counter.
Index of a connection seen from rank ``me`` talking to ``peer``: (peer, channel, slice).
Flag words sit 64 bytes apart so that no two pollers share a sector.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.gc3.ir import Protocol

from kernels.interp.preset import Fifo

FLAG_STRIDE = 64
PROTOS = (Protocol.SIMPLE, Protocol.LL)


@dataclass(frozen=True)
class Layout:
    nranks: int
    max_channels: int
    max_split: int
    fifo: dict[Protocol, Fifo]

    @property
    def nconn(self) -> int:
        return self.nranks * self.max_channels * self.max_split

    def conn(self, peer: int, chan: int, j: int) -> int:
        return (peer * self.max_channels + chan) * self.max_split + j

    def _fifo_base(self, proto: Protocol) -> int:
        off = 0
        for p in PROTOS:
            if p == proto:
                return off
            off += self.nconn * self.fifo[p].slots * self.fifo[p].slot_bytes
        raise KeyError(proto)

    @property
    def _flags_base(self) -> int:
        return sum(self.nconn * self.fifo[p].slots * self.fifo[p].slot_bytes for p in PROTOS)

    def fifo_off(self, proto: Protocol, conn: int) -> int:
        f = self.fifo[proto]
        return self._fifo_base(proto) + conn * f.slots * f.slot_bytes

    def _flag(self, proto: Protocol, word: int, conn: int) -> int:
        # word: 0 tail, 1 head, 2 send counter, 3 receive counter
        return self._flags_base + ((PROTOS.index(proto) * 4 + word) * self.nconn + conn) * FLAG_STRIDE

    def tail_off(self, proto: Protocol, conn: int) -> int:
        return self._flag(proto, 0, conn)

    def head_off(self, proto: Protocol, conn: int) -> int:
        return self._flag(proto, 1, conn)

    def send_counter_off(self, proto: Protocol, conn: int) -> int:
        return self._flag(proto, 2, conn)

    def recv_counter_off(self, proto: Protocol, conn: int) -> int:
        return self._flag(proto, 3, conn)

    @property
    def nbytes(self) -> int:
        return self._flags_base + len(PROTOS) * 4 * self.nconn * FLAG_STRIDE

    def send_conn(self, proto: Protocol, me: int, peer: int, chan: int, j: int,
                  bases: list[int]) -> tuple[int, int, int, int]:
        """(fifo, tail, head, counter) addresses of rank ``me``'s sending end; ``bases``: every rank's
        pool address as mapped in ``me``'s process."""
        at_peer = self.conn(me, chan, j)
        mine = self.conn(peer, chan, j)
        return (bases[peer] + self.fifo_off(proto, at_peer), bases[peer] + self.tail_off(proto, at_peer),
                bases[me] + self.head_off(proto, mine), bases[me] + self.send_counter_off(proto, mine))

    def recv_conn(self, proto: Protocol, me: int, peer: int, chan: int, j: int,
                  bases: list[int]) -> tuple[int, int, int, int]:
        """(fifo, tail, head, counter) addresses of rank ``me``'s receiving end."""
        mine = self.conn(peer, chan, j)
        at_peer = self.conn(me, chan, j)
        return (bases[me] + self.fifo_off(proto, mine), bases[me] + self.tail_off(proto, mine),
                bases[peer] + self.head_off(proto, at_peer), bases[me] + self.recv_counter_off(proto, mine))
