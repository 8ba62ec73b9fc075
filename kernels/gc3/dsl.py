"""The GC3 chunk DSL (GC3 §3): a program object, chunk references, copy and reduce.

    spec = CollectiveSpec("allreduce", ranks=4, chunks=4, inplace=True)
    prog = GC3Program("ring", spec, protocol=Protocol.LL, instances=2)
    c = prog.chunk(0, Buffer.INPUT, 1)
    c = c.copy(1, Buffer.SCRATCH, 0, ch=0)
    c = prog.chunk(1, Buffer.INPUT, 1).reduce(c, ch=0)
    ir = compile_program(prog)            # kernels.gc3.compiler

Vector form: ``rank`` and ``index`` may be integer arrays (of one length n, or
scalars broadcast to it): the reference then names n chunk ranges, and a copy or
reduce of it records n ops at once, in array order, exactly as n scalar calls in
that order would (if the n ops touch a slot twice, they are traced one by one).
A ring step over all ranks is one call:

    r = np.arange(R)
    c = prog.chunk(r, Buffer.INPUT, r).copy((r + 1) % R, Buffer.INPUT, r)

Tracing keeps the symbolic content of every chunk slot: the set of input chunks
(rank, index) summed into it, as one input index and a bit mask of ranks (a row
of R/64 words; the few values that mix several indexes are kept as a ``Value``
aside: a tuple of (index, rank mask) pairs sorted by index). That rejects a
read of an uninitialised chunk, a reduction that would add an input twice, a
stale reference (a ``ChunkRef`` whose slots were overwritten since it was taken)
and, at compile time, a final state that misses the postcondition. Offsets and
counts are logical chunks, before the ``instances`` replication done by the
compiler. In-place programs alias buffers as ``kernels.gc3.semantics``
describes, so ``Buffer.OUTPUT`` of an in-place allreduce is its input buffer.

Cost: a call on n references of c chunks is O(n c R / 64) array work (plus an
O(n c log(n c)) check that its slots are distinct) and O(1) Python; the ops go
to columns (``kernels.gc3.oplog``). Memory: R / 8 + 16 bytes per slot of each
buffer used (the slot state is dense: ranks x buffer size), plus the op columns.
"""
from __future__ import annotations

from contextlib import contextmanager
import numpy as np

from calibrate.errors import UserError
from kernels.gc3.arrays import isin
from kernels.gc3.ir import Buffer, Protocol
from kernels.gc3.oplog import OpLog, OpTable
from kernels.gc3.spec import CollectiveSpec
from kernels.gc3.slots import SlotStore, Value, pairs_of



def _vector(rank, index, n: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``rank`` and ``index`` as int64 arrays of one length (``n`` if given), single values repeated."""
    rank = np.asarray(rank, dtype=np.int64)
    index = np.asarray(index, dtype=np.int64)
    if n is None:
        n = max(rank.size if rank.ndim else 1, index.size if index.ndim else 1)
    out = []
    for a in (rank, index):
        if a.ndim == 0 or a.size == 1:
            a = np.full(n, a.reshape(-1)[0] if a.ndim else a, dtype=np.int64)
        elif a.ndim != 1 or len(a) != n:
            raise UserError(f"rank and index arrays of a chunk reference must have one length ({n}); "
                            f"give arrays of equal length or single values")
        out.append(a)
    return out[0], out[1]


def _one(ch, e: int):
    """The channel directive of op ``e`` of a call."""
    return ch if ch is None or np.ndim(ch) == 0 else int(np.asarray(ch)[e])


class ChunkRef:
    """A reference to ``count`` consecutive chunks of one rank's buffer (or to n such ranges, with array
    ``rank`` and ``index``), valid until they are overwritten."""

    __slots__ = ("prog", "_rank", "buffer", "_index", "count", "_sbuf", "_sidx", "versions", "_scalar",
                 "_slot_cache", "_row_cache", "_taken_at")

    def __init__(self, prog: "GC3Program", rank: np.ndarray, buf: Buffer, index: np.ndarray, count: int,
                 sbuf: Buffer, sidx: np.ndarray, versions: np.ndarray, scalar: bool):
        self.prog, self._rank, self.buffer, self._index, self.count = prog, rank, buf, index, count
        self._sbuf, self._sidx, self.versions, self._scalar = sbuf, sidx, versions, scalar
        self._slot_cache = self._row_cache = None
        self._taken_at = len(prog._log)     # ops recorded when the versions were read

    @property
    def rank(self):
        return int(self._rank[0]) if self._scalar else self._rank

    @property
    def index(self):
        return int(self._index[0]) if self._scalar else self._index

    def __len__(self):
        return len(self._rank)

    def _name(self, e: int) -> str:
        i = int(self._index[e])
        return f"chunk(rank {int(self._rank[e])}, {self.buffer.name.lower()}[{i}:{i + self.count}])"

    def __repr__(self):
        if len(self._rank) == 1:
            return self._name(0)
        return f"{len(self._rank)} chunk ranges ({self._name(0)}, ...)"

    def _slots(self) -> np.ndarray:
        """Storage indexes of every chunk, shape (n, count)."""
        if self._slot_cache is None:
            c = self.count
            self._slot_cache = self._sidx[:, None] if c == 1 else self._sidx[:, None] + np.arange(c)[None, :]
        return self._slot_cache

    def _rows(self) -> np.ndarray:
        """Rows of every chunk in the slot store, shape (n, count) (scratch may have grown since)."""
        width = self.prog._store.width[self._sbuf]
        if self._row_cache is None or self._row_cache[0] != width:
            self._row_cache = (width, self.prog._store.flat(self._sbuf, self._rank, self._slots()))
        return self._row_cache[1]

    def _check_fresh(self, action: str) -> None:
        """Raise if any slot was overwritten since the reference was taken."""
        if self._taken_at == len(self.prog._log):
            return
        store = self.prog._store
        now = store.versions(self._sbuf, self._rows())
        bad = np.flatnonzero((now != self.versions).any(axis=1))
        if len(bad):
            e = int(bad[0])
            k = int(np.flatnonzero(now[e] != self.versions[e])[0])
            raise UserError(f"stale reference {self._name(e)} used to {action}: {self._sbuf.name.lower()}"
                            f"[{int(self._sidx[e]) + k}] of rank {int(self._rank[e])} was overwritten after it "
                            f"was taken; take a new chunk(...) reference")

    def _element(self, e: int) -> "ChunkRef":
        s = slice(e, e + 1)
        out = ChunkRef(self.prog, self._rank[s], self.buffer, self._index[s], self.count, self._sbuf,
                       self._sidx[s], self.versions[s], True)
        out._taken_at = self._taken_at
        return out

    def copy(self, rank, buffer: Buffer, index, ch=None) -> "ChunkRef":
        """Copy these chunks to ``buffer[index:]`` of ``rank``; returns a reference to the copy. ``ch`` is a
        channel directive (one, or one per chunk range), None to let the compiler choose."""
        prog = self.prog
        dst = prog._ref(rank, buffer, index, self.count, len(self._rank), check_values=False)
        if not prog._distinct(self, dst, "copy"):
            return prog._one_by_one([self._element(e).copy(int(dst._rank[e]), buffer, int(dst._index[e]),
                                                           _one(ch, e))
                                     for e in range(len(dst))], self._scalar)
        self._check_fresh("copy")
        prog._record(0, self, dst, ch)
        return prog._write_copy(self, dst)

    def reduce(self, other: "ChunkRef", ch=None) -> "ChunkRef":
        """Reduce ``other`` into these chunks (this += other); ``other`` may be on another rank."""
        prog = self.prog
        if other.count != self.count:
            raise UserError(f"cannot reduce {other!r} into {self!r}: counts differ")
        if len(other) != len(self):
            raise UserError(f"cannot reduce {len(other)} chunk ranges into {len(self)}: give as many of each")
        if not prog._distinct(other, self, "reduce"):
            return prog._one_by_one([self._element(e).reduce(other._element(e), _one(ch, e)) for e in range(len(self))],
                                    self._scalar)
        self._check_fresh("reduce into")
        other._check_fresh("reduce from")
        prog._write_reduce(other, self)
        prog._record(1, other, self, ch)
        return prog._written(self)


class GC3Program:
    """A GC3 program under construction. No global state: all of it lives here."""

    def __init__(self, name: str, spec: CollectiveSpec, protocol: Protocol | str = Protocol.SIMPLE,
                 instances: int = 1):
        if instances < 1:
            raise UserError(f"instances must be >= 1, got {instances}")
        self.name, self.spec, self.instances = name, spec, instances
        self.protocol = Protocol(protocol) if isinstance(protocol, str) else protocol
        self._log = OpLog()
        self._store = SlotStore(spec)
        self._parallel = 1
        self._scope = 0
        self.scratch_chunks = np.zeros(spec.ranks, dtype=np.int64)

    @property
    def ranks(self) -> int:
        return self.spec.ranks

    @property
    def ops(self) -> OpTable:
        """The traced ops, in columns."""
        return self._log.table()

    def chunk(self, rank, buffer: Buffer, index, count: int = 1) -> ChunkRef:
        """A reference to ``count`` chunks of ``buffer`` at ``index`` on ``rank`` (ints or arrays)."""
        return self._ref(rank, buffer, index, count, None, check_values=True)

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
        sbuf, sidx = self.spec.storage(np.array([rank]), buffer, np.array([index]))
        return self._store.value(sbuf, rank, int(sidx[0]))

    def check_postcondition(self) -> None:
        """O(R * output chunks * R / 64), in blocks of ranks."""
        spec = self.spec
        if spec.kind == "custom":
            for slot, want in spec._post.items():
                self._check_slot(slot, want)
            return
        bad = self._store.first_unmet(spec)
        if bad is not None:
            self._check_slot(bad, spec.required(bad))

    def _check_slot(self, slot: tuple, want: Value) -> None:
        r, b, i = slot
        got = self._store.value(b, r, i)
        if got != want:
            have = "nothing" if got is None else f"{len(pairs_of(got))} input chunk(s) {pairs_of(got)[:4]}"
            need = pairs_of(want)
            raise UserError(f"postcondition not met: rank {r} {b.name.lower()}[{i}] holds {have} but the "
                            f"{self.spec.kind} needs {need[:4]}{'...' if len(need) > 4 else ''}")

    # ---- internals -------------------------------------------------------------------
    def _ref(self, rank, buffer: Buffer, index, count: int, n: int | None, check_values: bool) -> ChunkRef:
        scalar = np.ndim(rank) == 0 and np.ndim(index) == 0 and n in (None, 1)
        rank, index = _vector(rank, index, n)
        spec = self.spec
        if rank.min() < 0 or rank.max() >= spec.ranks:
            bad = rank[(rank < 0) | (rank >= spec.ranks)][0]
            raise UserError(f"rank {int(bad)} outside 0..{spec.ranks - 1}")
        if type(buffer) is not Buffer:
            buffer = Buffer(buffer)
        sizes = spec.sizes(buffer)
        if count < 1 or index.min() < 0 or (sizes is not None and (index + count > sizes[rank]).any()):
            e = int(np.flatnonzero((index < 0) | (count < 1) | (
                index + count > (sizes[rank] if sizes is not None else np.inf)))[0])
            size = None if sizes is None else int(sizes[rank[e]])
            raise UserError(f"{buffer.name.lower()}[{int(index[e])}:{int(index[e]) + count}] on rank "
                            f"{int(rank[e])} is outside the buffer of {size} chunks; fix the index or count")
        if buffer == Buffer.SCRATCH:
            np.maximum.at(self.scratch_chunks, rank, index + count)
        sbuf, sidx = spec.storage(rank, buffer, index)
        store = self._store
        store.reserve(sbuf, int(sidx.max()) + count)
        ref = ChunkRef(self, rank, buffer, index, count, sbuf, sidx, None, scalar)
        rows = ref._rows()
        if check_values:
            empty = store.empty(sbuf, rows)
            if empty.any():
                e, k = (int(x[0]) for x in np.nonzero(empty))
                raise UserError(f"op #{len(self._log)} (reference) reads an uninitialised chunk: rank "
                                f"{int(rank[e])} {sbuf.name.lower()}[{int(sidx[e]) + k}]; copy data there first")
        ref.versions = store.versions(sbuf, rows)
        return ref

    def _distinct(self, src: ChunkRef, dst: ChunkRef, kind: str) -> bool:
        """Whether the n ops of this call can be traced at once: no op writes a slot that another writes or
        reads (else they are traced one by one, in order). A copy onto itself is rejected."""
        same = (src._rank == dst._rank) & (src._sbuf == dst._sbuf) & (src._sidx == dst._sidx)
        if kind == "copy" and same.any():
            raise UserError(f"copy of {src._name(int(np.flatnonzero(same)[0]))} onto itself")
        if len(dst) == 1:
            return True
        k_dst = np.sort(dst._rows().reshape(-1))
        if (k_dst[1:] == k_dst[:-1]).any():
            return False
        return src._sbuf != dst._sbuf or not isin(src._rows().reshape(-1), k_dst).any()

    def _one_by_one(self, refs: list[ChunkRef], scalar: bool) -> ChunkRef:
        first = refs[0]
        out = ChunkRef(self, np.concatenate([r._rank for r in refs]), first.buffer,
                       np.concatenate([r._index for r in refs]), first.count, first._sbuf,
                       np.concatenate([r._sidx for r in refs]), np.concatenate([r.versions for r in refs]),
                       scalar and len(refs) == 1)
        out._taken_at = -1    # versions of different moments: always check them
        return out

    def _record(self, kind: int, src: ChunkRef, dst: ChunkRef, ch) -> None:
        code = -1 if ch is None else np.asarray(ch, dtype=np.int64)
        if ch is not None and (code.ndim and len(code) != len(dst)):
            raise UserError(f"{len(code)} channel directives for {len(dst)} chunk ranges; give one or as many")
        if ch is not None and (code < 0).any():
            raise UserError(f"channel directive ch={int(np.min(code))} must be >= 0")
        self._log.append(kind, src._rank, src._sbuf, src._sidx, dst._rank, dst._sbuf, dst._sidx, dst.count,
                         code, self._parallel, self._scope if self._parallel > 1 else 0)

    def _write_copy(self, src: ChunkRef, dst: ChunkRef) -> ChunkRef:
        self._store.copy(src._sbuf, src._rows(), dst._sbuf, dst._rows())
        return self._written(dst)

    def _write_reduce(self, src: ChunkRef, dst: ChunkRef) -> None:
        clash = self._store.reduce(src._sbuf, src._rows(), dst._sbuf, dst._rows())
        if clash is not None:
            e, k, both = clash
            raise UserError(f"reducing {src._name(e)} into {dst._name(e)} would add input chunks "
                            f"{pairs_of(both)} twice (at chunk {k}); reduce disjoint partial sums")

    def _written(self, ref: ChunkRef) -> ChunkRef:
        """``ref`` after the last recorded op (one version per element) wrote it."""
        n = len(ref)
        versions = len(self._log) - n + 1 + np.arange(n)
        self._store.set_versions(ref._sbuf, ref._rows(), versions)
        out = ChunkRef(self, ref._rank, ref.buffer, ref._index, ref.count, ref._sbuf, ref._sidx,
                       np.repeat(versions[:, None], ref.count, axis=1), ref._scalar)
        out._slot_cache, out._row_cache = ref._slot_cache, ref._row_cache
        return out
