"""The traced ops of a GC3 program, in columns.

An op copies or reduces ``count`` consecutive chunks from a source storage slot
range to a destination one (storage: after in-place aliasing). ``OpLog`` takes
them a call at a time (n ops of one kind, count and channel directive) and
``OpTable`` holds them all as arrays, in trace order; O(n) per call.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.gc3.ir import Buffer

BUFFERS = list(Buffer)
COPY, REDUCE = 0, 1


@dataclass
class OpTable:
    kind: np.ndarray        # COPY or REDUCE
    src_rank: np.ndarray
    src_buf: np.ndarray     # codes into BUFFERS
    src_idx: np.ndarray
    dst_rank: np.ndarray
    dst_buf: np.ndarray
    dst_idx: np.ndarray
    count: np.ndarray
    ch: np.ndarray          # channel directive, -1 for none
    parallel: np.ndarray    # replicas of the parallelize() scope the op was traced in
    scope: np.ndarray       # that scope's number, 0 outside one

    def __len__(self) -> int:
        return len(self.kind)


class OpLog:
    """Ops a call at a time; ``table`` joins the calls so far into one ``OpTable`` and keeps only that (the
    calls' own arrays are dropped, so a traced program holds its ops once)."""

    def __init__(self):
        self._parts: list[tuple] = []
        self._n = 0
        self._table: OpTable | None = None

    def __len__(self) -> int:
        return self._n

    def append(self, kind: int, src_rank, src_buf: Buffer, src_idx, dst_rank, dst_buf: Buffer, dst_idx,
               count: int, ch, parallel: int, scope: int) -> None:
        """n ops: rank and index arrays of length n, ``ch`` one directive or n of them."""
        self._parts.append((kind, src_rank, BUFFERS.index(src_buf), src_idx, dst_rank, BUFFERS.index(dst_buf),
                            dst_idx, count, np.broadcast_to(ch, len(src_rank)), parallel, scope))
        self._n += len(src_rank)

    def table(self) -> OpTable:
        if self._parts or self._table is None:
            parts = self._parts
            sizes = np.array([len(p[1]) for p in parts], dtype=np.int64)
            old = [] if self._table is None else [self._table]

            def scalar(k, dtype):
                new = np.repeat(np.array([p[k] for p in parts], dtype=dtype), sizes)
                return np.concatenate([getattr(t, FIELDS[k]) for t in old] + [new])

            def column(k):
                return np.concatenate([getattr(t, FIELDS[k]) for t in old] + [p[k] for p in parts] +
                                      [np.zeros(0, np.int64)]).astype(np.int64, copy=False)
            self._table = OpTable(scalar(0, np.int8), column(1), scalar(2, np.int8), column(3), column(4),
                                  scalar(5, np.int8), column(6), scalar(7, np.int64), column(8),
                                  scalar(9, np.int64), scalar(10, np.int64))
            self._parts = []
        return self._table


FIELDS = list(OpTable.__dataclass_fields__)
