"""The symbolic state of every chunk slot during a GC3 trace, in arrays.

A slot holds a sum of input chunks (rank, index). Nearly always they share one
index, so a slot is stored as that index (or ``NONE``: nothing, ``MULTI``: see
below) and a rank bit mask of W = ceil(R / 64) words; a storage buffer of every
rank is an (R, width) index array, an (R, width, W) mask array and an
(R, width) version array (1 + the index of the op that last wrote the slot, 0
if none did). A value mixing several indexes is kept as a ``Value`` (a tuple of
(index, rank mask) pairs sorted by index) in a dictionary, its index being
``MULTI``. Scratch grows by doubling its width.

Cost: a copy or reduce of k slots is O(k W) array work; a slot with a ``MULTI``
value costs O(its value) Python. Memory: (8 W + 16) bytes per slot of every
buffer used.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from kernels.gc3.ir import Buffer

NONE = -1
MULTI = -2
Value = tuple  # ((input chunk index, rank mask), ...) sorted by index


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


def merge(a: Value, b: Value) -> tuple[Value, Value]:
    """(a + b, the chunks both hold)."""
    da, db = dict(a), dict(b)
    both = tuple((k, da[k] & m) for k, m in sorted(db.items()) if da.get(k, 0) & m)
    for k, m in db.items():
        da[k] = da.get(k, 0) | m
    return tuple(sorted(da.items())), both


class SlotStore:
    """Values and versions of the storage slots of one traced program; slot (rank, i) of a buffer is row
    rank * width + i of its arrays."""

    def __init__(self, spec):
        self.spec = spec
        self.R = spec.ranks
        self.W = (spec.ranks + 63) // 64
        self.width: dict[Buffer, int] = {}
        self.idx: dict[Buffer, np.ndarray] = {}
        self.mask: dict[Buffer, np.ndarray] = {}
        self.ver: dict[Buffer, np.ndarray] = {}
        self.multi: dict[tuple, Value] = {}   # (buffer, rank, index) -> Value, where idx is MULTI

    def _int(self, row: np.ndarray) -> int:
        return int.from_bytes(np.ascontiguousarray(row, dtype="<u8").tobytes(), "little")

    def _row(self, value: int) -> np.ndarray:
        return np.frombuffer(value.to_bytes(8 * self.W, "little"), dtype="<u8")

    def reserve(self, buf: Buffer, width: int) -> None:
        """Make slots 0..width-1 of ``buf`` exist on every rank (filled with the initial state)."""
        have = self.width.get(buf, 0)
        if width <= have:
            return
        spec = self.spec
        if buf == Buffer.SCRATCH:
            width = max(width, 2 * have)
        else:
            width = max(width, int(spec.sizes(buf).max()))
        idx = np.full((self.R, width), NONE, dtype=np.int64)
        mask = np.zeros((self.R, width, self.W), dtype=np.uint64)
        ver = np.zeros((self.R, width), dtype=np.int64)
        if have:
            idx[:, :have] = self.idx[buf].reshape(self.R, have)
            mask[:, :have] = self.mask[buf].reshape(self.R, have, self.W)
            ver[:, :have] = self.ver[buf].reshape(self.R, have)
        elif spec.kind != "custom":
            rows = spec.initial_rows(buf, width)
            if rows is not None:
                idx[:] = rows
                r = np.arange(self.R)
                bit = np.left_shift(np.uint64(1), (r % 64).astype(np.uint64))[:, None]
                mask[r, :, r // 64] = np.where(rows != NONE, bit, np.uint64(0))
        self.width[buf] = width
        self.idx[buf], self.mask[buf], self.ver[buf] = idx.reshape(-1), mask.reshape(-1, self.W), ver.reshape(-1)
        if not have and spec.kind == "custom":
            for (r, b, i), value in spec._pre.items():
                if b == buf and 0 <= i < width:
                    self._set(buf, r * width + i, value)

    def flat(self, buf: Buffer, rank: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Rows of slots (rank, slots) of ``buf``, shape of ``slots``."""
        return rank[:, None] * self.width[buf] + slots

    def _set(self, buf, row: int, value: Value) -> None:
        if len(value) == 1:
            self.idx[buf][row] = value[0][0]
            self.mask[buf][row] = self._row(value[0][1])
        else:
            self.idx[buf][row] = MULTI
            self.multi[(buf, row // self.width[buf], row % self.width[buf])] = value

    def value(self, buf: Buffer, rank: int, index: int) -> Value | None:
        self.reserve(buf, index + 1)
        row = rank * self.width[buf] + index
        k = int(self.idx[buf][row])
        if k == NONE:
            return None
        if k == MULTI:
            return self.multi[(buf, rank, index)]
        return ((k, self._int(self.mask[buf][row])),)

    def _masks(self, buf: Buffer, rows: np.ndarray) -> np.ndarray:
        """The masks of ``rows`` (any shape; the result has one more axis, of W words). Rows are gathered and
        scattered through 1-d indexes: numpy's path for a 2-d index into rows is several times slower."""
        return np.take(self.mask[buf], rows.reshape(-1), axis=0).reshape(rows.shape + (self.W,))

    def versions(self, buf: Buffer, rows: np.ndarray) -> np.ndarray:
        return self.ver[buf][rows]

    def set_versions(self, buf: Buffer, rows: np.ndarray, versions: np.ndarray) -> None:
        self.ver[buf][rows.reshape(-1)] = np.repeat(versions, rows.shape[1]) if rows.shape[1] > 1 else versions

    def empty(self, buf: Buffer, rows: np.ndarray) -> np.ndarray:
        return self.idx[buf][rows] == NONE

    def copy(self, sbuf, srows, dbuf, drows) -> None:
        """Rows ``drows`` of ``dbuf`` take the values of rows ``srows`` of ``sbuf``."""
        k = self.idx[sbuf][srows]
        self.idx[dbuf][drows.reshape(-1)] = k.reshape(-1)
        self.mask[dbuf][drows.reshape(-1)] = self._masks(sbuf, srows.reshape(-1))
        if (k == MULTI).any():
            ws, wd = self.width[sbuf], self.width[dbuf]
            for a, b in zip(srows[k == MULTI].tolist(), drows[k == MULTI].tolist()):
                self.multi[(dbuf, b // wd, b % wd)] = self.multi[(sbuf, a // ws, a % ws)]

    def reduce(self, sbuf, srows, dbuf, drows) -> tuple[int, int, Value] | None:
        """Rows ``drows`` of ``dbuf`` += rows ``srows`` of ``sbuf`` (shape (n, count)); or, if some input chunk
        would be added twice, nothing changes and the first such (op, chunk, chunks held twice) is returned."""
        ka = self.idx[dbuf][drows]
        kb = self.idx[sbuf][srows]
        ma = self._masks(dbuf, drows)
        mb = self._masks(sbuf, srows)
        one = (ka >= 0) & (ka == kb)
        clash = one & (ma & mb).any(axis=-1)
        merged = {}
        ws, wd = self.width[sbuf], self.width[dbuf]
        for e, c in np.argwhere(~one).tolist():
            a, b = int(drows[e, c]), int(srows[e, c])
            va = self.value(dbuf, a // wd, a % wd)
            vb = self.value(sbuf, b // ws, b % ws)
            merged[(e, c)] = total, both = merge(va, vb)
            if both:
                clash[e, c] = True
        if clash.any():
            e, c = (int(x) for x in np.argwhere(clash)[0])
            if (e, c) in merged:
                return e, c, merged[(e, c)][1]
            return e, c, ((int(ka[e, c]), self._int(ma[e, c] & mb[e, c])),)
        self.mask[dbuf][drows.reshape(-1)] = (ma | mb).reshape(-1, self.W)
        for (e, c), (total, _) in merged.items():
            self._set(dbuf, int(drows[e, c]), total)
        return None

    def first_unmet(self, spec, block: int = 64) -> tuple | None:
        """The first storage slot (rank, buffer, index), rank by rank, whose value is not the one a built-in
        collective requires; None if all are. Ranks are checked ``block`` at a time (bounded memory)."""
        nout = spec.buffer_chunks(0, Buffer.OUTPUT)
        full = np.zeros(self.W, dtype=np.uint64)
        for r in range(self.R):
            full[r // 64] |= np.uint64(1) << np.uint64(r % 64)
        for q0 in range(0, self.R, block):
            ranks = np.arange(q0, min(q0 + block, self.R))
            k_out = np.tile(np.arange(nout), len(ranks))
            rank = np.repeat(ranks, nout)
            buf, sidx = spec.storage(rank, Buffer.OUTPUT, k_out)
            self.reserve(buf, int(sidx.max()) + 1)
            want_idx, holder = spec.required_rows(rank, k_out)
            rows = rank * self.width[buf] + sidx
            got_idx = self.idx[buf][rows]
            got = self._masks(buf, rows)
            if holder is None:
                ok = (got == full).all(axis=1)
            else:
                want = np.zeros_like(got)
                want[np.arange(len(rank)), holder // 64] = np.left_shift(np.uint64(1), (holder % 64).astype(np.uint64))
                ok = (got == want).all(axis=1)
            ok &= got_idx == want_idx
            if not ok.all():
                e = int(np.flatnonzero(~ok)[0])
                return int(rank[e]), buf, int(sidx[e])
        return None
