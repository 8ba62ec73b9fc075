"""The GC3 chunk DSL (GC3 §3): a program object, chunk references, copy and reduce.

    spec = CollectiveSpec("allreduce", ranks=4, chunks=4, inplace=True)
    prog = GC3Program("ring", spec, protocol=Protocol.LL, instances=2)
    c = prog.chunk(0, Buffer.INPUT, 1)
    c = c.copy(1, Buffer.SCRATCH, 0, ch=0)
    c = prog.chunk(1, Buffer.INPUT, 1).reduce(c, ch=0)
    ir = compile_program(prog)            # kernels.gc3.compiler

Tracing keeps the symbolic content of every chunk slot: the set of input chunks
(rank, index) summed into it, stored as a ``Value``: a tuple of (index, rank
mask) pairs sorted by index, the mask's bit p set when rank p's input chunk
``index`` is in the sum (most values name one index, so a reduction is one OR of
two integers). That rejects a read of an uninitialised chunk, a
reduction that would add an input twice, a stale reference (a ``ChunkRef``
whose slots were overwritten since it was taken) and, at compile time, a final
state that misses the postcondition. Offsets and counts are logical chunks,
before the ``instances`` replication done by the compiler. In-place programs
alias buffers as ``kernels.gc3.semantics`` describes, so ``Buffer.OUTPUT`` of an
in-place allreduce is its input buffer.

Cost: tracing an op is O(count) dictionary operations plus O(R / 64) word
operations per reduced chunk (the masks); the built-in collectives' pre- and
postconditions are computed per slot on demand (no table of R * C entries), so
memory is O(slots written + ops).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from calibrate.errors import UserError
from kernels.gc3.ir import Buffer, Protocol
from kernels.gc3.semantics import alias_index, logical_index

Value = tuple  # ((input chunk index, rank mask), ...) sorted by index
Slot = tuple  # (rank, Buffer, index): a storage slot, after in-place aliasing
KINDS = ("allreduce", "reducescatter", "allgather", "alltoall", "custom")


def value_of(pairs: Iterable[tuple[int, int]]) -> Value:
    """The ``Value`` holding the input chunks ``pairs`` ((rank, index) each)."""
    masks: dict[int, int] = {}
    for rank, index in pairs:
        masks[index] = masks.get(index, 0) | (1 << rank)
    return tuple(sorted(masks.items()))


def pairs_of(value: Value) -> list[tuple[int, int]]:
    """The (rank, index) input chunks of ``value``, sorted."""
    out = []
    for index, mask in value:
        rank = 0
        while mask:
            if mask & 1:
                out.append((rank, index))
            mask >>= 1
            rank += 1
    return sorted(out)


def _merge(a: Value, b: Value) -> tuple[Value, Value]:
    """(a + b, the chunks both hold)."""
    if len(a) == 1 and len(b) == 1 and a[0][0] == b[0][0]:
        ma, mb = a[0][1], b[0][1]
        return ((a[0][0], ma | mb),), (((a[0][0], ma & mb),) if ma & mb else ())
    da, db = dict(a), dict(b)
    both = tuple((k, da[k] & m) for k, m in sorted(db.items()) if da.get(k, 0) & m)
    for k, m in db.items():
        da[k] = da.get(k, 0) | m
    return tuple(sorted(da.items())), both


@dataclass
class CollectiveSpec:
    """A collective's signature and conditions.

    ``chunks`` is C, the number of logical chunks in the collective's buffer (the
    output for allgather, the input otherwise). A custom collective gives its own
    ``precondition`` (slot -> input chunk ids it holds, a frozenset of (rank,
    index)) and ``postcondition`` (slot -> value required at the end), and its
    per-rank buffer sizes; a built-in one computes them per slot
    (``initial``, ``required``).
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
        if self.kind not in KINDS:
            raise UserError(f"unknown collective {self.kind!r}; expected allreduce, reducescatter, "
                            f"allgather, alltoall or custom")
        if self.kind in ("allgather", "reducescatter", "alltoall") and self.chunks % self.ranks:
            raise UserError(f"{self.kind} needs chunks ({self.chunks}) to be a multiple of ranks ({self.ranks})")
        self._all = (1 << self.ranks) - 1
        self._per = self.chunks // self.ranks
        if self.kind == "custom":
            if not self.postcondition or not self.custom_name:
                raise UserError("a custom collective needs a name, a precondition and a postcondition")
            self._pre = {s: value_of(v) for s, v in self.precondition.items()}
            self._post = {s: value_of(v) for s, v in self.postcondition.items()}
        # which user buffers in-place aliasing maps elsewhere (others are stored as themselves)
        self._aliased = {b for b in Buffer if any(
            alias_index(self.kind, self.inplace, self.ranks, self.chunks, r, b, 0)[0] != b
            for r in range(min(self.ranks, 2)))}

    def slot(self, rank: int, buf: Buffer, index: int) -> Slot:
        if buf not in self._aliased:
            return (rank, buf, index)
        b, i = alias_index(self.kind, self.inplace, self.ranks, self.chunks, rank, buf, index)
        return (rank, b, i)

    def slots(self, rank: int, buf: Buffer, index: int, count: int) -> list[Slot]:
        if buf not in self._aliased:
            return [(rank, buf, index + k) for k in range(count)]
        return [self.slot(rank, buf, index + k) for k in range(count)]

    def buffer_chunks(self, rank: int, buf: Buffer) -> int | None:
        """Logical size of a user buffer (None: unbounded, for scratch)."""
        if buf == Buffer.SCRATCH:
            return None
        if self.kind == "custom":
            return (self.input_sizes if buf == Buffer.INPUT else self.output_sizes)[rank]
        if buf == Buffer.INPUT:
            return self._per if self.kind == "allgather" else self.chunks
        return self._per if self.kind == "reducescatter" else self.chunks

    def _logical(self, slot: Slot, buf: Buffer) -> int | None:
        r, b, i = slot
        k = logical_index(self.kind, self.inplace, self.ranks, self.chunks, r, b, i, buf)
        return k if k is not None and 0 <= k < self.buffer_chunks(r, buf) else None

    def initial(self, slot: Slot) -> Value | None:
        """What ``slot`` holds before the collective starts (None: nothing)."""
        if self.kind == "custom":
            return self._pre.get(slot)
        r, b, i = slot
        if self.kind != "allgather":
            return ((i, 1 << r),) if b == Buffer.INPUT and 0 <= i < self.chunks else None
        if self.inplace:
            lo = r * self._per
            return ((i - lo, 1 << r),) if b == Buffer.OUTPUT and lo <= i < lo + self._per else None
        return ((i, 1 << r),) if b == Buffer.INPUT and 0 <= i < self._per else None

    def required(self, slot: Slot) -> Value | None:
        """What ``slot`` must hold at the end (None: anything)."""
        if self.kind == "custom":
            return self._post.get(slot)
        k = self._logical(slot, Buffer.OUTPUT)
        if k is None:
            return None
        r, per = slot[0], self._per
        if self.kind == "allreduce":
            return ((k, self._all),)
        if self.kind == "reducescatter":
            return ((r * per + k, self._all),)
        if self.kind == "allgather":
            return ((k % per, 1 << (k // per)),)
        return ((r * per + k % per, 1 << (k // per)),)

    def output_slots(self) -> Iterator[Slot]:
        """Every slot with a required value, rank by rank; O(R * output chunks)."""
        if self.kind == "custom":
            yield from self._post
            return
        for q in range(self.ranks):
            for k in range(self.buffer_chunks(q, Buffer.OUTPUT)):
                yield self.slot(q, Buffer.OUTPUT, k)


# an op: (kind "copy" | "reduce", src slot, dst slot, count, channel directive or None,
#         replicas of the parallelize() scope it was traced in, that scope's number or 0)
Op = tuple
OP_KIND, OP_SRC, OP_DST, OP_COUNT, OP_CH, OP_PARALLEL, OP_SCOPE = range(7)


class ChunkRef:
    """A reference to ``count`` consecutive chunks of one rank's buffer, valid until they are overwritten."""

    __slots__ = ("prog", "rank", "buffer", "index", "count", "slots", "versions", "values")

    def __init__(self, prog: "GC3Program", rank: int, buf: Buffer, index: int, count: int,
                 slots: list[Slot], versions: list[int], values: list[Value] | None = None):
        self.prog, self.rank, self.buffer, self.index, self.count = prog, rank, buf, index, count
        self.slots, self.versions, self.values = slots, versions, values

    def __repr__(self):
        return f"chunk(rank {self.rank}, {self.buffer.name.lower()}[{self.index}:{self.index + self.count}])"

    def _check_fresh(self, action: str) -> list[Value]:
        """The values of the slots (read when the reference was taken); raise if any was overwritten since."""
        cells = self.prog._cells
        for s, v in zip(self.slots, self.versions):
            cell = cells.get(s)
            if (cell[1] if cell is not None else 0) != v:
                raise UserError(f"stale reference {self!r} used to {action}: {s[1].name.lower()}[{s[2]}] of rank "
                                f"{s[0]} was overwritten after it was taken; take a new chunk(...) reference")
        return self.values

    def copy(self, rank: int, buffer: Buffer, index: int, ch: int | None = None) -> "ChunkRef":
        """Copy these chunks to ``buffer[index:]`` of ``rank``; returns a reference to the copy."""
        values = self._check_fresh("copy")
        dst = self.prog._ref(rank, buffer, index, self.count)
        self.prog._record("copy", self, dst, ch)
        return self.prog._write(dst, values)

    def reduce(self, other: "ChunkRef", ch: int | None = None) -> "ChunkRef":
        """Reduce ``other`` into these chunks (this += other); ``other`` may be on another rank."""
        mine = self._check_fresh("reduce into")
        theirs = other._check_fresh("reduce from")
        if other.count != self.count:
            raise UserError(f"cannot reduce {other!r} into {self!r}: counts differ")
        merged = []
        for k, (a, b) in enumerate(zip(mine, theirs)):
            m, both = _merge(a, b)
            if both:
                raise UserError(f"reducing {other!r} into {self!r} would add input chunks "
                                f"{pairs_of(both)} twice (at chunk {k}); reduce disjoint partial sums")
            merged.append(m)
        self.prog._record("reduce", other, self, ch)
        return self.prog._write(self, merged)


class GC3Program:
    """A GC3 program under construction. No global state: all of it lives here."""

    def __init__(self, name: str, spec: CollectiveSpec, protocol: Protocol | str = Protocol.SIMPLE,
                 instances: int = 1):
        if instances < 1:
            raise UserError(f"instances must be >= 1, got {instances}")
        self.name, self.spec, self.instances = name, spec, instances
        self.protocol = Protocol(protocol) if isinstance(protocol, str) else protocol
        self.ops: list[Op] = []
        self._cells: dict[Slot, tuple[Value, int]] = {}  # written slots: (value, 1 + index of the writing op)
        self._parallel = 1
        self._scope = 0
        self.scratch_chunks = [0] * spec.ranks

    @property
    def ranks(self) -> int:
        return self.spec.ranks

    def chunk(self, rank: int, buffer: Buffer, index: int, count: int = 1) -> ChunkRef:
        """A reference to ``count`` chunks of ``buffer`` at ``index`` on ``rank``."""
        ref = self._ref(rank, buffer, index, count)
        ref.values = self._values(ref, "reference")
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

    def _get(self, slot: Slot) -> Value | None:
        cell = self._cells.get(slot)
        return cell[0] if cell is not None else self.spec.initial(slot)

    def state(self, rank: int, buffer: Buffer, index: int) -> Value | None:
        return self._get(self.spec.slot(rank, buffer, index))

    def check_postcondition(self) -> None:
        """O(R * output chunks)."""
        spec = self.spec
        for slot in spec.output_slots():
            want, got = spec.required(slot), self._get(slot)
            if got != want:
                r, b, i = slot
                have = "nothing" if got is None else f"{len(pairs_of(got))} input chunk(s) {pairs_of(got)[:4]}"
                need = pairs_of(want)
                raise UserError(f"postcondition not met: rank {r} {b.name.lower()}[{i}] holds {have} but the "
                                f"{spec.kind} needs {need[:4]}{'...' if len(need) > 4 else ''}")

    # ---- internals -------------------------------------------------------------------
    def _ref(self, rank: int, buffer: Buffer, index: int, count: int) -> ChunkRef:
        if not 0 <= rank < self.spec.ranks:
            raise UserError(f"rank {rank} outside 0..{self.spec.ranks - 1}")
        if type(buffer) is not Buffer:
            buffer = Buffer(buffer)
        size = self.spec.buffer_chunks(rank, buffer)
        if index < 0 or count < 1 or (size is not None and index + count > size):
            raise UserError(f"{buffer.name.lower()}[{index}:{index + count}] on rank {rank} is outside the "
                            f"buffer of {size} chunks; fix the index or count")
        if buffer == Buffer.SCRATCH and index + count > self.scratch_chunks[rank]:
            self.scratch_chunks[rank] = index + count
        slots = self.spec.slots(rank, buffer, index, count)
        cells = self._cells
        versions = [cells[s][1] if s in cells else 0 for s in slots]
        return ChunkRef(self, rank, buffer, index, count, slots, versions)

    def _values(self, ref: ChunkRef, action: str) -> list[Value]:
        out = []
        for s in ref.slots:
            v = self._get(s)
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
        self.ops.append((kind, src.slots[0], dst.slots[0], src.count, ch,
                         self._parallel, self._scope if self._parallel > 1 else 0))

    def _write(self, ref: ChunkRef, values: list[Value]) -> ChunkRef:
        version = len(self.ops)
        cells = self._cells
        for s, v in zip(ref.slots, values):
            cells[s] = (v, version)
        return ChunkRef(self, ref.rank, ref.buffer, ref.index, ref.count, ref.slots, [version] * ref.count,
                        values)
