"""A collective's signature for the GC3 DSL: buffer sizes, in-place aliasing, pre- and postconditions,
per slot and in array form (``kernels.gc3.dsl`` traces programs against it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from calibrate.errors import UserError
from kernels.gc3.ir import Buffer
from kernels.gc3.semantics import alias_index, logical_index
from kernels.gc3.slots import NONE, Value, value_of

KINDS = ("allreduce", "reducescatter", "allgather", "alltoall", "custom")


@dataclass
class CollectiveSpec:
    """A collective's signature and conditions.

    ``chunks`` is C, the number of logical chunks in the collective's buffer (the
    output for allgather, the input otherwise). A custom collective gives its own
    ``precondition`` (slot -> input chunk ids it holds, a frozenset of (rank,
    index)) and ``postcondition`` (slot -> value required at the end), and its
    per-rank buffer sizes; a built-in one computes them (``initial_rows``,
    ``required``, ``required_rows``).
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
        self._sizes = {b: np.array([self.buffer_chunks(r, b) or 0 for r in range(self.ranks)], dtype=np.int64)
                       for b in (Buffer.INPUT, Buffer.OUTPUT)} if self.kind == "custom" else {
            b: np.full(self.ranks, self.buffer_chunks(0, b), dtype=np.int64) for b in (Buffer.INPUT, Buffer.OUTPUT)}

    def storage(self, rank: np.ndarray, buf: Buffer, index: np.ndarray) -> tuple[Buffer, np.ndarray]:
        """The storage buffer and index of chunks ``buf[index]`` of ``rank`` (arrays), after aliasing."""
        b, off = alias_index(self.kind, self.inplace, self.ranks, self.chunks, 0, buf, 0)
        if b == buf:
            return buf, index
        base = np.zeros_like(rank) if off == 0 and self.kind == "allreduce" else rank * self._per
        return b, index + base

    def sizes(self, buf: Buffer) -> np.ndarray | None:
        """Logical size of a user buffer per rank (None: unbounded, for scratch)."""
        return None if buf == Buffer.SCRATCH else self._sizes[buf]

    def buffer_chunks(self, rank: int, buf: Buffer) -> int | None:
        """Logical size of a user buffer (None: unbounded, for scratch)."""
        if buf == Buffer.SCRATCH:
            return None
        if self.kind == "custom":
            return (self.input_sizes if buf == Buffer.INPUT else self.output_sizes)[rank]
        if buf == Buffer.INPUT:
            return self._per if self.kind == "allgather" else self.chunks
        return self._per if self.kind == "reducescatter" else self.chunks

    def initial_rows(self, buf: Buffer, width: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Initial state of storage buffer ``buf`` of every rank (``width`` slots each) for a built-in
        collective: (the input index each slot holds or NONE, shape (R, width)), the holder's rank being the
        slot's rank; None if the collective starts with nothing there."""
        r = np.arange(self.ranks)[:, None]
        i = np.arange(width)[None, :]
        if self.kind != "allgather":
            if buf != Buffer.INPUT:
                return None
            return np.broadcast_to(np.where(i < self.chunks, i, NONE), (self.ranks, width)).copy()
        if self.inplace:
            if buf != Buffer.OUTPUT:
                return None
            lo = r * self._per
            return np.where((lo <= i) & (i < lo + self._per), i - lo, NONE)
        if buf != Buffer.INPUT:
            return None
        return np.broadcast_to(np.where(i < self._per, i, NONE), (self.ranks, width)).copy()

    def required(self, slot: tuple) -> Value | None:
        """What storage slot (rank, buffer, index) must hold at the end (None: anything)."""
        if self.kind == "custom":
            return self._post.get(slot)
        k = self._logical(slot[0], slot[1], slot[2])
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

    def _logical(self, r: int, b: Buffer, i: int) -> int | None:
        k = logical_index(self.kind, self.inplace, self.ranks, self.chunks, r, b, i, Buffer.OUTPUT)
        return k if k is not None and 0 <= k < self.buffer_chunks(r, Buffer.OUTPUT) else None

    def is_output(self, rank: np.ndarray, buf: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Whether storage slots (arrays of rank, buffer code into ``list(Buffer)``, index) have a required
        value at the end."""
        if self.kind == "custom":
            bufs = list(Buffer)
            return np.fromiter(((r, bufs[b], i) in self._post for r, b, i in
                                zip(rank.tolist(), buf.tolist(), index.tolist())), dtype=bool, count=len(rank))
        code = {b: k for k, b in enumerate(Buffer)}
        if self.inplace and self.kind == "reducescatter":
            k, ok = index - rank * self._per, buf == code[Buffer.INPUT]
        elif self.inplace and self.kind == "allreduce":
            k, ok = index, buf == code[Buffer.INPUT]
        else:
            k, ok = index, buf == code[Buffer.OUTPUT]
        return ok & (k >= 0) & (k < self._sizes[Buffer.OUTPUT][rank])

    def required_rows(self, rank: np.ndarray, index_out: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """For output chunks ``index_out`` (logical) of ``rank``: (the required input index, the required
        holder rank, or None where all ranks are required)."""
        per = self._per
        if self.kind == "allreduce":
            return index_out, None
        if self.kind == "reducescatter":
            return rank * per + index_out, None
        if self.kind == "allgather":
            return index_out % per, index_out // per
        return rank * per + index_out % per, index_out // per
