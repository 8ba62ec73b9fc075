"""The GC3 chunk DSL (GC3 §3): a program object, chunk references, copy and reduce.

    spec = CollectiveSpec("allreduce", ranks=4, chunks=4, inplace=True)
    prog = GC3Program("ring", spec, protocol=Protocol.LL, instances=2)
    c = prog.chunk(0, Buffer.INPUT, 1)
    c = c.copy(1, Buffer.SCRATCH, 0, ch=0)
    c = prog.chunk(1, Buffer.INPUT, 1).reduce(c, ch=0)
    ir = compile_program(prog)            # kernels.gc3.compiler

Tracing keeps the symbolic content of every chunk slot: the set of input chunks
(rank, index) summed into it. That rejects a read of an uninitialised chunk, a
reduction that would add an input twice, a stale reference (a ``ChunkRef``
whose slots were overwritten since it was taken) and, at compile time, a final
state that misses the postcondition. Offsets and counts are logical chunks,
before the ``instances`` replication done by the compiler. In-place programs
alias buffers as ``kernels.gc3.semantics`` describes, so ``Buffer.OUTPUT`` of an
in-place allreduce is its input buffer.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from calibrate.errors import UserError
from kernels.gc3.ir import Buffer, Protocol
from kernels.gc3.semantics import alias_index

Value = frozenset  # of (rank, input chunk index)
Slot = tuple  # (rank, Buffer, index): a storage slot, after in-place aliasing


@dataclass
class CollectiveSpec:
    """A collective's signature and conditions.

    ``chunks`` is C, the number of logical chunks in the collective's buffer (the
    output for allgather, the input otherwise). A custom collective gives its own
    ``precondition`` (slot -> input chunk ids it holds) and ``postcondition``
    (slot -> value required at the end), and its per-rank buffer sizes.
    """

    kind: str
    ranks: int
    chunks: int
    inplace: bool = False
    precondition: dict = field(default_factory=dict)
    postcondition: dict = field(default_factory=dict)
    custom_name: str = ""
    input_sizes: list[int] = field(default_factory=list)
    output_sizes: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.ranks < 2:
            raise UserError(f"a collective needs at least 2 ranks, got {self.ranks}")
        if self.chunks < 1:
            raise UserError(f"chunks must be >= 1, got {self.chunks}")
        if self.kind in ("allgather", "reducescatter", "alltoall") and self.chunks % self.ranks:
            raise UserError(f"{self.kind} needs chunks ({self.chunks}) to be a multiple of ranks ({self.ranks})")
        if self.kind == "custom":
            if not self.postcondition or not self.custom_name:
                raise UserError("a custom collective needs a name, a precondition and a postcondition")
            return
        per = self.chunks // self.ranks
        r, c = self.ranks, self.chunks
        pre, post = {}, {}
        for q in range(r):
            nin = per if self.kind == "allgather" else c
            for k in range(nin):
                pre[self.slot(q, Buffer.INPUT, k)] = frozenset({(q, k)})
        for q in range(r):
            if self.kind == "allreduce":
                want = {k: frozenset((p, k) for p in range(r)) for k in range(c)}
            elif self.kind == "reducescatter":
                want = {k: frozenset((p, q * per + k) for p in range(r)) for k in range(per)}
            elif self.kind == "allgather":
                want = {k: frozenset({(k // per, k % per)}) for k in range(c)}
            elif self.kind == "alltoall":
                want = {k: frozenset({(k // per, q * per + k % per)}) for k in range(c)}
            else:
                raise UserError(f"unknown collective {self.kind!r}; expected allreduce, reducescatter, "
                                f"allgather, alltoall or custom")
            for k, v in want.items():
                post[self.slot(q, Buffer.OUTPUT, k)] = v
        self.precondition, self.postcondition = pre, post

    def slot(self, rank: int, buf: Buffer, index: int) -> Slot:
        b, i = alias_index(self.kind, self.inplace, self.ranks, self.chunks, rank, buf, index)
        return (rank, b, i)

    def buffer_chunks(self, rank: int, buf: Buffer) -> int | None:
        """Logical size of a user buffer (None: unbounded, for scratch)."""
        if buf == Buffer.SCRATCH:
            return None
        if self.kind == "custom":
            return (self.input_sizes if buf == Buffer.INPUT else self.output_sizes)[rank]
        per = self.chunks // self.ranks
        if buf == Buffer.INPUT:
            return per if self.kind == "allgather" else self.chunks
        return per if self.kind == "reducescatter" else self.chunks


@dataclass
class Op:
    """One traced operation: copy or reduce ``count`` chunks from src into dst."""

    id: int
    kind: str  # "copy" | "reduce"
    src: Slot
    dst: Slot
    count: int
    ch: int | None
    parallel: int = 1   # replicas of the parallelize() scope it was traced in
    scope: int = 0


class ChunkRef:
    """A reference to ``count`` consecutive chunks of one rank's buffer, valid until they are overwritten."""

    def __init__(self, prog: "GC3Program", rank: int, buf: Buffer, index: int, count: int):
        self.prog, self.rank, self.buffer, self.index, self.count = prog, rank, buf, index, count
        self.slots = [prog.spec.slot(rank, buf, index + k) for k in range(count)]
        self.versions = [prog._version.get(s, 0) for s in self.slots]

    def __repr__(self):
        return f"chunk(rank {self.rank}, {self.buffer.name.lower()}[{self.index}:{self.index + self.count}])"

    def _check_fresh(self, action: str) -> None:
        for s, v in zip(self.slots, self.versions):
            if self.prog._version.get(s, 0) != v:
                raise UserError(f"stale reference {self!r} used to {action}: {s[1].name.lower()}[{s[2]}] of rank "
                                f"{s[0]} was overwritten after it was taken; take a new chunk(...) reference")

    def copy(self, rank: int, buffer: Buffer, index: int, ch: int | None = None) -> "ChunkRef":
        """Copy these chunks to ``buffer[index:]`` of ``rank``; returns a reference to the copy."""
        self._check_fresh("copy")
        dst = self.prog._ref(rank, buffer, index, self.count)
        values = self.prog._values(self, "copy")
        self.prog._record("copy", self, dst, ch)
        return self.prog._write(dst, values)

    def reduce(self, other: "ChunkRef", ch: int | None = None) -> "ChunkRef":
        """Reduce ``other`` into these chunks (this += other); ``other`` may be on another rank."""
        self._check_fresh("reduce into")
        other._check_fresh("reduce from")
        if other.count != self.count:
            raise UserError(f"cannot reduce {other!r} into {self!r}: counts differ")
        mine, theirs = self.prog._values(self, "reduce"), self.prog._values(other, "reduce")
        merged = []
        for k, (a, b) in enumerate(zip(mine, theirs)):
            if a & b:
                raise UserError(f"reducing {other!r} into {self!r} would add input chunks "
                                f"{sorted(a & b)} twice (at chunk {k}); reduce disjoint partial sums")
            merged.append(a | b)
        self.prog._record("reduce", other, self, ch)
        return self.prog._write(self.prog._ref(self.rank, self.buffer, self.index, self.count), merged)


class GC3Program:
    """A GC3 program under construction. No global state: all of it lives here."""

    def __init__(self, name: str, spec: CollectiveSpec, protocol: Protocol | str = Protocol.SIMPLE,
                 instances: int = 1):
        if instances < 1:
            raise UserError(f"instances must be >= 1, got {instances}")
        self.name, self.spec, self.instances = name, spec, instances
        self.protocol = Protocol(protocol) if isinstance(protocol, str) else protocol
        self.ops: list[Op] = []
        self._state: dict[Slot, Value] = dict(spec.precondition)
        self._version: dict[Slot, int] = {}
        self._parallel = 1
        self._scope = 0
        self.scratch_chunks = [0] * spec.ranks

    @property
    def ranks(self) -> int:
        return self.spec.ranks

    def chunk(self, rank: int, buffer: Buffer, index: int, count: int = 1) -> ChunkRef:
        """A reference to ``count`` chunks of ``buffer`` at ``index`` on ``rank``."""
        ref = self._ref(rank, buffer, index, count)
        self._values(ref, "reference")
        return ref

    @contextmanager
    def parallelize(self, n: int):
        """Ops traced inside run as ``n`` replicas, each moving 1/n of the chunks on its own channels."""
        if n < 1 or self._parallel != 1:
            raise UserError("parallelize(n) needs n >= 1 and cannot be nested")
        self._parallel, self._scope = n, self._scope + 1
        try:
            yield
        finally:
            self._parallel = 1

    def state(self, rank: int, buffer: Buffer, index: int) -> Value | None:
        return self._state.get(self.spec.slot(rank, buffer, index))

    def check_postcondition(self) -> None:
        for slot, want in self.spec.postcondition.items():
            got = self._state.get(slot)
            if got != want:
                r, b, i = slot
                have = "nothing" if got is None else f"{len(got)} input chunk(s) {sorted(got)[:4]}"
                raise UserError(f"postcondition not met: rank {r} {b.name.lower()}[{i}] holds {have} but the "
                                f"{self.spec.kind} needs {sorted(want)[:4]}{'...' if len(want) > 4 else ''}")

    # ---- internals -------------------------------------------------------------------
    def _ref(self, rank: int, buffer: Buffer, index: int, count: int) -> ChunkRef:
        if not 0 <= rank < self.ranks:
            raise UserError(f"rank {rank} outside 0..{self.ranks - 1}")
        buffer = Buffer(buffer)
        size = self.spec.buffer_chunks(rank, buffer)
        if index < 0 or count < 1 or (size is not None and index + count > size):
            raise UserError(f"{buffer.name.lower()}[{index}:{index + count}] on rank {rank} is outside the "
                            f"buffer of {size} chunks; fix the index or count")
        if buffer == Buffer.SCRATCH:
            self.scratch_chunks[rank] = max(self.scratch_chunks[rank], index + count)
        return ChunkRef(self, rank, buffer, index, count)

    def _values(self, ref: ChunkRef, action: str) -> list[Value]:
        out = []
        for s in ref.slots:
            v = self._state.get(s)
            if v is None:
                raise UserError(f"op #{len(self.ops)} ({action}) reads an uninitialised chunk: rank {s[0]} "
                                f"{s[1].name.lower()}[{s[2]}]; copy data there first")
            out.append(v)
        return out

    def _record(self, kind: str, src: ChunkRef, dst: ChunkRef, ch: int | None) -> None:
        if ch is not None and ch < 0:
            raise UserError(f"channel directive ch={ch} must be >= 0")
        if kind == "copy" and src.slots == dst.slots:
            raise UserError(f"copy of {src!r} onto itself")
        self.ops.append(Op(len(self.ops), kind, src.slots[0], dst.slots[0], src.count, ch,
                           self._parallel, self._scope if self._parallel > 1 else 0))

    def _write(self, ref: ChunkRef, values: list[Value]) -> ChunkRef:
        for s, v in zip(ref.slots, values):
            self._state[s] = v
            self._version[s] = self._version.get(s, 0) + 1
        return ChunkRef(self, ref.rank, ref.buffer, ref.index, ref.count)
