"""Boxing cost tables between consecutive layers, computed once per problem.

``EdgeTables`` holds, per edge (a, b) of the layer graph, the seconds per
training step of boxing layer a's output into layer b's input for every pair
of their strategies (micro-batches x (forward + backward), one occurrence).
A search then reads a whole table (exhaustive, dynamic programming) or one row
or column of it (a coordinate-descent line search), never a boxing path.

Small problems get every table up front (``precompute``); large ones (GPT-3
175B on 4096 GPUs has ~10^6 pairs per edge) compute rows and columns on first
use and keep them.

Pairs are memoised by a canonical key: the cost of a boxing depends only on
the tensor shape and the multiset of per-fine-axis transitions (axis size,
whether it crosses nodes, source and destination placement), since a step's
collective is timed on its group's size and node count alone and evenly
divisible intermediates depend on the products of the splitting axes, not on
their order. Edges of equal shape (a transformer's residual stream) share it.
"""
from __future__ import annotations

import math

import numpy as np

from calibrate.errors import UserError

from autotune.sbp.boxing import Coster, box, copy_seconds
from autotune.sbp.sbp import dual
from autotune.sbp.layers import ACT_BYTES, Strategy
from autotune.sbp.rowbox import RowBoxer, dual_code, encode

# precompute every table when the edges hold at most this many strategy pairs in all
PRECOMPUTE_PAIRS = 6_000_000


def edge_steps(producer: Strategy, consumer: Strategy, shape, cluster, itemsize=ACT_BYTES):
    """(forward steps, backward steps) of moving producer's output into consumer's input; backward, the
    gradient the consumer returns (``fine_grad_in``) into the dual of the producer's output. ``itemsize``:
    bytes an element, or (forward, backward)."""
    fb = (itemsize, itemsize) if isinstance(itemsize, int) else itemsize
    fwd = box(shape, fb[0], producer.fine_out, consumer.fine_in, cluster)
    bwd = box(shape, fb[1], consumer.fine_grad_in, tuple(dual(p) for p in producer.fine_out), cluster)
    return fwd, bwd


class EdgeTables:
    def __init__(self, choices: list[list[Strategy]], shapes: list, edges, coster: Coster, micro_batches: int,
                 precompute: bool | None = None, progress=None, itemsize=ACT_BYTES, memory_seconds=None,
                 forward_factor: dict | None = None, boxer=None):
        """``itemsize``: bytes of an element an edge's tensor is sent in, one for all, or edge (a, b) ->
        (forward, backward) bytes (``autotune.sbp.memory.edge_bytes``: under autocast the norms' and the
        residual stream's fp32, the matmuls' bf16). ``memory_seconds`` (bytes -> seconds): add DTensor's local copies
        around each step (``autotune.sbp.boxing.local_copies``), as the step-time objective does.
        ``forward_factor``: edge (a, b) -> how many times its forward boxing runs per micro-batch on average
        over its occurrences (default 1; full recomputation re-runs a block's forward boxings). ``boxer``:
        itemsize -> a ``RowBoxer`` to share (its memo does not depend on the factors)."""
        self.choices, self.shapes, self.coster, self.mb = choices, shapes, coster, micro_batches
        self.forward_factor = forward_factor or {}
        self.memory_seconds = memory_seconds
        self.sizes = (lambda a, b: (itemsize, itemsize)) if isinstance(itemsize, int) else itemsize
        self.cluster = coster.cluster
        self.edges = list(edges)
        self._memo: dict = {}
        self._full: dict[tuple[int, int], np.ndarray] = {}
        self._lines: dict[tuple, np.ndarray] = {}
        own: dict[int, RowBoxer] = {}
        self.boxer = boxer or (lambda size: own.setdefault(size, RowBoxer(coster, size, memory_seconds)))
        self._codes: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        pairs = sum(len(choices[a]) * len(choices[b]) for a, b in self.edges if a != b)
        self.precomputed = pairs <= PRECOMPUTE_PAIRS if precompute is None else precompute
        if self.precomputed:
            for i, (a, b) in enumerate(self.edges):
                if progress:
                    progress(f"boxing table {i + 1}/{len(self.edges)}: {len(choices[a])} x {len(choices[b])}")
                if a == b:
                    self.diagonal(a)
                else:
                    self.table(a, b)

    def _key(self, shape, src, dst, grad) -> tuple:
        cl = self.cluster
        return shape, tuple(sorted(zip(cl.axis_sizes, cl.axis_inter, src, dst, grad)))

    def pair(self, a: int, b: int, i: int, j: int) -> float:
        """Seconds per step of one occurrence of edge (a, b) with strategies i and j; inf if impossible."""
        full = self._full.get((a, b))
        if full is not None:
            return float(full[i, j])
        return self.pair_direct(a, b, i, j)

    def pair_direct(self, a: int, b: int, i: int, j: int) -> float:
        """``pair`` by walking the boxing path (memoised by the canonical key)."""
        sa, sb = self.choices[a][i], self.choices[b][j]
        sizes = self.sizes(a, b)
        key = (sizes, self._key(self.shapes[a], sa.fine_out, sb.fine_in, sb.fine_grad_in))
        t = self._memo.get(key)
        if t is None:
            try:
                fwd, bwd = edge_steps(sa, sb, self.shapes[a], self.cluster, sizes)
                t = (self.coster.time(fwd), self.coster.time(bwd))
                if self.memory_seconds is not None:
                    t = (t[0] + copy_seconds(fwd, self.memory_seconds), t[1] + copy_seconds(bwd, self.memory_seconds))
            except UserError:  # no evenly divisible path between these two layouts
                t = (math.inf, math.inf)
            self._memo[key] = t
        return self.mb * (self.forward_factor.get((a, b), 1.0) * t[0] + t[1])

    def codes(self, v: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer v's strategies as integer codes per fine axis: (output, dual of output, input, input's gradient)."""
        c = self._codes.get(v)
        if c is None:
            ss = self.choices[v]
            out = np.array([encode(s.fine_out) if s.fine_out else () for s in ss], dtype=np.int64)
            c = self._codes[v] = (out, dual_code(out),
                                  np.array([encode(s.fine_in) if s.fine_in else () for s in ss], dtype=np.int64),
                                  np.array([encode(s.fine_grad_in) if s.fine_grad_in else () for s in ss], dtype=np.int64))
        return c

    def _block(self, a: int, b: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Edge (a, b) for every producer strategy in ``i`` and consumer strategy in ``j`` (index arrays):
        a len(i) x len(j) array, forward and backward, times micro-batches."""
        out_a, dual_a, _, _ = self.codes(a)
        _, _, in_b, grad_b = self.codes(b)
        shape = self.shapes[a]
        f = self.forward_factor.get((a, b), 1.0)
        fwd, bwd = (self.boxer(size) for size in self.sizes(a, b))
        return self.mb * (f * fwd.table(shape, out_a[i], in_b[j]) + bwd.table(shape, grad_b[j], dual_a[i]).T)

    def forget_lazy(self) -> None:
        """Drop what was computed on demand (a fresh start for timing a search); precomputed tables stay."""
        self._memo.clear()
        self._lines.clear()
        if not self.precomputed:
            self._full.clear()

    def table(self, a: int, b: int) -> np.ndarray:
        """The whole |choices a| x |choices b| table (kept)."""
        full = self._full.get((a, b))
        if full is None:
            full = self._block(a, b, np.arange(len(self.choices[a])), np.arange(len(self.choices[b])))
            self._full[(a, b)] = full
        return full

    def column(self, a: int, b: int, j: int) -> np.ndarray:
        """Costs over a's strategies with b fixed at j."""
        full = self._full.get((a, b))
        if full is not None:
            return full[:, j]
        key = (a, b, 0, j)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = self._block(a, b, np.arange(len(self.choices[a])), np.array([j]))[:, 0]
        return line

    def row(self, a: int, b: int, i: int) -> np.ndarray:
        """Costs over b's strategies with a fixed at i."""
        full = self._full.get((a, b))
        if full is not None:
            return full[i, :]
        key = (a, b, 1, i)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = self._block(a, b, np.array([i]), np.arange(len(self.choices[b])))[0]
        return line

    def diagonal(self, a: int) -> np.ndarray:
        """A layer feeding itself (a repeated block of one layer): both ends take the same strategy."""
        key = (a, a, 2, 0)
        line = self._lines.get(key)
        if line is None:
            out_a, dual_a, in_a, grad_a = self.codes(a)
            shape = self.shapes[a]
            f = self.forward_factor.get((a, a), 1.0)
            fwd, bwd = (self.boxer(size) for size in self.sizes(a, a))
            line = self._lines[key] = self.mb * (f * fwd.cost(shape, out_a, in_a) + bwd.cost(shape, grad_a, dual_a))
        return line
