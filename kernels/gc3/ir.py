"""The GC3 intermediate representation: what the compiler emits, the MSCCL XML
holds, the reference executor proves and the CUDA interpreter runs.

It mirrors the MSCCL XML schema (../shared/interop/msccl/README.md):
Program (algo) > Gpu > ThreadBlock (tb) > Step. Offsets and counts are in
chunks. A step may wait on steps of other thread blocks of the same GPU
(``deps``: (thread block id, step index) pairs); ``has_dep`` says that some
other step waits on this one, so it must signal when done.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

IR_VERSION = 1


class Buffer(str, Enum):
    INPUT = "i"
    OUTPUT = "o"
    SCRATCH = "s"


class Protocol(str, Enum):
    SIMPLE = "Simple"
    LL = "LL"
    LL128 = "LL128"


class StepType(str, Enum):
    """Instructions of the IR (GC3 §4.2), with MSCCL's XML spelling."""

    SEND = "s"
    RECV = "r"
    RECV_COPY_SEND = "rcs"
    RECV_REDUCE_SEND = "rrs"
    RECV_REDUCE_COPY = "rrc"
    RECV_REDUCE_COPY_SEND = "rrcs"
    COPY = "cpy"
    REDUCE = "re"
    NOP = "nop"

    @property
    def sends(self) -> bool:
        return self in SENDING

    @property
    def receives(self) -> bool:
        return self in RECEIVING

    @property
    def reduces(self) -> bool:
        return self in REDUCING


SENDING = frozenset({StepType.SEND, StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_SEND,
                     StepType.RECV_REDUCE_COPY_SEND})
RECEIVING = frozenset({StepType.RECV, StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_SEND,
                       StepType.RECV_REDUCE_COPY, StepType.RECV_REDUCE_COPY_SEND})
REDUCING = frozenset({StepType.RECV_REDUCE_SEND, StepType.RECV_REDUCE_COPY, StepType.RECV_REDUCE_COPY_SEND,
                      StepType.REDUCE})


@dataclass(slots=True)
class Step:
    s: int
    type: StepType
    srcbuf: Buffer
    srcoff: int
    dstbuf: Buffer
    dstoff: int
    cnt: int
    deps: list[tuple[int, int]] = field(default_factory=list)
    has_dep: bool = False


@dataclass
class ThreadBlock:
    id: int
    send: int = -1
    recv: int = -1
    chan: int = 0
    steps: list[Step] = field(default_factory=list)


@dataclass
class Gpu:
    id: int
    i_chunks: int
    o_chunks: int
    s_chunks: int
    threadblocks: list[ThreadBlock] = field(default_factory=list)

    def chunks(self, buf: Buffer) -> int:
        return {Buffer.INPUT: self.i_chunks, Buffer.OUTPUT: self.o_chunks,
                Buffer.SCRATCH: self.s_chunks}[buf]


@dataclass
class Program:
    """One compiled collective: MSCCL's ``algo`` element."""

    name: str
    collective: str
    ngpus: int
    nchunksperloop: int
    nchannels: int
    protocol: Protocol = Protocol.SIMPLE
    inplace: bool = False
    min_bytes: int = 0
    max_bytes: int = 0
    gpus: list[Gpu] = field(default_factory=list)

    @property
    def max_threadblocks(self) -> int:
        return max((len(g.threadblocks) for g in self.gpus), default=0)
