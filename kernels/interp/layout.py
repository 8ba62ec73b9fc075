"""Where the transport lives in each rank's connection pool.

Every rank allocates one pool of the same layout and maps every other rank's pool
through a CUDA IPC handle. A connection (sender, receiver, channel, slice) has,
per protocol:
  in the receiver's pool: its FIFO (slots x slot_bytes) and the receiver's line;
  in the sender's pool: the sender's line.
A line (LINE_BYTES) holds word 0, the end's own sequence counter, and word 1, the
word the peer writes: ``head`` in the sender's line (released by the receiver),
``tail`` in the receiver's line (Simple; released by the sender). One line per end
lets the kernel read its whole state in one round, without a pointer chase.
Index of a connection seen from rank ``me`` talking to ``peer``: (peer, channel, slice);
consecutive slices are consecutive indices, so slice j of an end lies j FIFOs and
j lines after slice 0 (the kernel relies on this).
"""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.errors import UserError
from kernels.gc3.ir import Protocol

from kernels.interp.preset import Fifo

LINE_BYTES = 64
PROTOS = (Protocol.SIMPLE, Protocol.LL, Protocol.LL128)
_SEND, _RECV = 0, 1


@dataclass(frozen=True)
class End:
    """Addresses of one end of a connection, for slice 0, as mapped in this rank's process:
    ``fifo`` (the FIFO, in the receiver's pool), ``line`` (ours), ``peer_line`` (the peer's)."""

    fifo: int
    line: int
    peer_line: int


@dataclass(frozen=True)
class Layout:
    nranks: int
    max_channels: int
    max_split: int
    fifo: dict[Protocol, Fifo]

    def __post_init__(self) -> None:
        for proto, f in self.fifo.items():
            if f.slots < 1 or f.slots & (f.slots - 1):
                raise UserError(f"fifo {proto.value} has {f.slots} slots; the interpreter needs a power of two "
                                f"(it picks a slot with a mask): change slots in the preset")

    @property
    def protos(self) -> tuple[Protocol, ...]:
        """The protocols with a FIFO in this layout, in PROTOS order (LL128 only when the preset has one)."""
        return tuple(p for p in PROTOS if p in self.fifo)

    @property
    def nconn(self) -> int:
        return self.nranks * self.max_channels * self.max_split

    def conn(self, peer: int, chan: int, j: int) -> int:
        return (peer * self.max_channels + chan) * self.max_split + j

    def fifo_bytes(self, proto: Protocol) -> int:
        return self.fifo[proto].slots * self.fifo[proto].slot_bytes

    def _fifo_base(self, proto: Protocol) -> int:
        return sum(self.nconn * self.fifo_bytes(p) for p in self.protos[:self.protos.index(proto)])

    @property
    def _lines_base(self) -> int:
        return sum(self.nconn * self.fifo_bytes(p) for p in self.protos)

    def fifo_off(self, proto: Protocol, conn: int) -> int:
        return self._fifo_base(proto) + conn * self.fifo_bytes(proto)

    def _line(self, proto: Protocol, kind: int, conn: int) -> int:
        return self._lines_base + ((self.protos.index(proto) * 2 + kind) * self.nconn + conn) * LINE_BYTES

    def send_line_off(self, proto: Protocol, conn: int) -> int:
        return self._line(proto, _SEND, conn)

    def recv_line_off(self, proto: Protocol, conn: int) -> int:
        return self._line(proto, _RECV, conn)

    @property
    def nbytes(self) -> int:
        return self._lines_base + len(self.protos) * 2 * self.nconn * LINE_BYTES

    def send_end(self, proto: Protocol, me: int, peer: int, chan: int, j: int, bases: list[int]) -> End:
        """Rank ``me``'s sending end; ``bases``: every rank's pool address as mapped in ``me``'s process."""
        at_peer, mine = self.conn(me, chan, j), self.conn(peer, chan, j)
        return End(bases[peer] + self.fifo_off(proto, at_peer), bases[me] + self.send_line_off(proto, mine),
                   bases[peer] + self.recv_line_off(proto, at_peer))

    def recv_end(self, proto: Protocol, me: int, peer: int, chan: int, j: int, bases: list[int]) -> End:
        """Rank ``me``'s receiving end."""
        mine, at_peer = self.conn(peer, chan, j), self.conn(me, chan, j)
        return End(bases[me] + self.fifo_off(proto, mine), bases[me] + self.recv_line_off(proto, mine),
                   bases[peer] + self.send_line_off(proto, at_peer))
