"""Boxing costs of many redistributions at once, from counts of transitions per class of fine axes.

A coordinate-descent line search needs the cost of boxing one producer's
output into every strategy of its consumer (a row of a boxing table);
dynamic programming needs whole tables: GPT-3 on 4,096 GPUs has ~1,000
strategies a layer, ~500,000 pairs an edge, far too many to walk
``autotune.sbp.boxing.box`` one pair at a time. ``RowBoxer`` follows the same
path as ``box`` (its first order: free slices, reduce-scatters intra-node
part first, one all-reduce, all-to-alls, all-gathers inter-node part first)
with the placements coded as integers per fine axis (S(d) -> d, B -> -1,
P -> -2).

What a pair's path costs depends only on how many axes of each *class* (axis
size, inter- or intra-node) make each transition: every step is a collective
over the axes of one transition (per tier), timed on its group's ranks and
nodes, and every message size is the tensor's size over the product of the
axes splitting each dimension. The transitions that matter are
    K(d)  B or S(d) -> S(d)   split on d throughout (a free slice comes first)
    RS(d) P -> S(d)           reduce-scatter
    AR    P -> B              all-reduce
    A(ij) S(i) -> S(j)        all-to-all
    AG(d) S(d) -> B or P      all-gather (a zeroing to P is free)
(B -> B, P -> P and B -> P change nothing). For a whole table the counts are
popcounts of the AND of bit masks (per placement, which of the class's axes
hold it) of every producer with every consumer, and a path step's time is looked up by a small integer key (the
group's counts per class and the split counts per class and dimension), so a
table costs a few dozen array passes plus one profile lookup per distinct
step. Pairs where an intermediate of that order does not divide evenly take
``box``'s other orders in turn (slices last; then all-gathers first too), and
cost inf where none divides. Equal to ``box`` to rounding: tested on every
pair of small problems. Given ``memory_seconds``, each step also costs
DTensor's local copies around it (``autotune.sbp.boxing.local_copies``: they
depend on the step's kind, its tensor dimensions and its message size, all
known on the path), as the step-time objective counts them.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from calibrate.collectives import Collective

from autotune.sbp.boxing import Coster, copies_around

CODE_B, CODE_P = -1, -2
CODES = {"B": CODE_B, "P": CODE_P}


@functools.lru_cache(maxsize=None)
def encode(fine: tuple[str, ...]) -> tuple[int, ...]:
    """The fine placements as codes (memoised: a large search encodes the same few hundred thousands of times)."""
    return tuple(CODES.get(p) or int(p[1:]) for p in fine)


def dual_code(codes: np.ndarray) -> np.ndarray:
    """B <-> P, S stays (the gradient's placement)."""
    return np.where(codes == CODE_B, CODE_P, np.where(codes == CODE_P, CODE_B, codes))


class RowBoxer:
    def __init__(self, coster: Coster, itemsize: int, memory_seconds=None, keep_tables: bool = False):
        """``memory_seconds`` (bytes -> seconds): also cost DTensor's local copies around each step
        (``autotune.sbp.boxing.local_copies``), as the step-time objective does. ``keep_tables``: remember
        every ``table`` by its codes (for many problems on one cluster that share layers: a pipeline's stages)."""
        self.coster, self.itemsize, self.memory_seconds = coster, itemsize, memory_seconds
        self._tables: dict[tuple, np.ndarray] | None = {} if keep_tables else None
        cl = coster.cluster
        groups: dict[tuple[int, bool], list[int]] = {}
        for a, key in enumerate(zip(cl.axis_sizes, cl.axis_inter)):
            groups.setdefault(key, []).append(a)
        self.classes = [(z, inter, np.array(axes)) for (z, inter), axes in groups.items()]
        self.radix = [len(axes) + 1 for _, _, axes in self.classes]
        self.weight = [math.prod(self.radix[:c]) for c in range(len(self.classes))]
        self.E = math.prod(self.radix)  # distinct count vectors over the classes
        self._steps: dict[tuple, tuple[np.ndarray, np.ndarray] | dict] = {}
        self._copies: dict[tuple, np.ndarray] = {}
        self._div: dict[tuple, np.ndarray] = {}

    # ---- counts ------------------------------------------------------------------------------------
    def _counts(self, src: np.ndarray, dst: np.ndarray, nd: int, outer: bool) -> list[dict]:
        """Per class, how many of its axes make each transition, times the class's weight in a key: arrays
        (n1, n2) if ``outer`` else (J,). Each side's placements are bit masks over the class's axes (one per placement), a count the
        popcount of their AND."""
        out = []
        pairs = [(i, j) for i in range(nd) for j in range(nd) if i != j]
        for (_, _, axes), weight in zip(self.classes, self.weight):
            bits = np.uint64(1) << np.arange(len(axes), dtype=np.uint64)

            def masks(codes, side):
                m = {v: ((codes[:, axes] == v) * bits).sum(axis=1, dtype=np.uint64) for v in (CODE_P, CODE_B, *range(nd))}
                return {v: (x[:, None] if side == 0 else x[None, :]) if outer else x for v, x in m.items()}

            s, d = masks(src, 0), masks(dst, 1)

            def count(x):  # times the class's weight in a split-count key
                return np.bitwise_count(x).astype(np.int32) * np.int32(weight)

            out.append({"K": [count((s[CODE_B] | s[k]) & d[k]) for k in range(nd)],
                        "AG": [count(s[k] & (d[CODE_B] | d[CODE_P])) for k in range(nd)],
                        "A": {(i, j): count(s[i] & d[j]) for i, j in pairs},
                        "RS": [count(s[CODE_P] & d[k]) for k in range(nd)],
                        "AR": count(s[CODE_P] & d[CODE_B]),
                        "slice": [count(s[CODE_B] & d[k]) for k in range(nd)]})
        return out

    # ---- lookups -----------------------------------------------------------------------------------
    def _decode(self, key: int) -> list[int]:
        return [(key // self.weight[c]) % self.radix[c] for c in range(len(self.classes))]

    def _product(self, key: int, only_inter: bool = False) -> int:
        return math.prod(z ** n for (z, inter, _), n in zip(self.classes, self._decode(key)) if inter or not only_inter)

    def _divides(self, shape: tuple[int, ...], d: int) -> np.ndarray:
        """Per split-count key of dimension d: whether the dimension divides by the product."""
        ok = self._div.get((shape, d))
        if ok is None:
            ok = self._div[(shape, d)] = np.array([shape[d] % self._product(k) == 0 for k in range(self.E)])
        return ok

    def _elems(self, shape: tuple[int, ...]) -> tuple[np.ndarray, list[int]]:
        """Per combination of split-count keys (dimension 0 + E x dimension 1 + ...): the index of one
        device's element count in a list of the distinct counts."""
        got = self._div.get((shape, "elems"))
        if got is None:
            vals: dict[int, int] = {}
            idx = np.empty(self.E ** len(shape), dtype=np.int64)
            for k in range(len(idx)):
                n, rest = 1, k
                for size in shape:
                    n *= size // self._product(rest % self.E)
                    rest //= self.E
                idx[k] = vals.setdefault(n, len(vals))
            got = self._div[(shape, "elems")] = (idx, list(vals))
        return got

    def _times(self, op: Collective, shape, key: np.ndarray) -> np.ndarray:
        """Seconds of one step per pair, from its key (the group's counts + E x the element count's index)."""
        idx, elems = self._elems(shape)
        span = self.E * len(elems)
        memo = self._steps.get((op, shape))
        if memo is None:
            memo = self._steps[(op, shape)] = (np.zeros(span), np.zeros(span, dtype=bool))
        vals, known = memo
        seen = np.zeros(span, dtype=bool)
        seen[key] = True
        for k in np.flatnonzero(seen & ~known).tolist():
            g = k % self.E
            ranks = self._product(g)
            vals[k] = 0.0 if ranks == 1 else self.coster.group_time(
                op, elems[k // self.E] * self.itemsize, ranks, self._product(g, only_inter=True))
            known[k] = True
        return vals[key]

    def _copy_times(self, shape, key: np.ndarray, copies: int) -> np.ndarray:
        """Seconds of ``copies`` local copies of a step's message per pair (0 where the group is empty)."""
        _, elems = self._elems(shape)
        per = self._copies.get(shape)
        if per is None:
            per = self._copies[shape] = np.array([self.memory_seconds(2 * e * self.itemsize) for e in elems])
        return np.where(key % self.E != 0, copies * per[key // self.E], 0.0)

    # ---- the path ----------------------------------------------------------------------------------
    def _walk(self, shape: tuple[int, ...], f: list[dict], early_slices: bool = True,
              gather_first: bool = False) -> np.ndarray:
        """The path in one of ``box``'s orders; NaN where an intermediate does not divide."""
        nd, C, E = len(shape), len(self.classes), self.E
        inter = [i for _, i, _ in self.classes]
        # split-count key of each dimension: sum over classes of count x weight (slices B -> S(d) are
        # counted in K(d); taken out here, they are moved in where the order makes them)
        dk = [sum(f[c]["K"][d] + f[c]["AG"][d] + sum(f[c]["A"][(d, j)] for j in range(nd) if j != d)
                  - f[c]["slice"][d] for c in range(C)) for d in range(nd)]
        comb = sum(dk[d] * np.int32(E ** d) for d in range(nd))  # every dimension's key in one
        total = np.zeros(f[0]["AR"].shape)
        bad = np.zeros(total.shape, dtype=bool)
        elem_idx = self._elems(shape)[0].astype(np.int32)

        def check(d):
            np.logical_or(bad, ~self._divides(shape, d)[dk[d]], out=bad)

        def group(g):  # g: per class the group's weighted axis count (None: not in the group); None if empty
            live = [x for x in g if x is not None and x.any()]
            return sum(live[1:], live[0]) if live else None

        def step(op, gw, src_dim=-1, dst_dim=-1):
            key = elem_idx[comb]
            key *= np.int32(E)
            key += gw
            if op != "slice":
                total[...] += self._times(op, shape, key)
            copies = copies_around(op, src_dim, dst_dim)
            if copies and self.memory_seconds is not None:
                total[...] += self._copy_times(shape, key, copies)

        def move(gw, d, sign):
            nonlocal comb
            dk[d] = dk[d] + gw if sign > 0 else dk[d] - gw
            comb = comb + gw * np.int32(E ** d) if sign > 0 else comb - gw * np.int32(E ** d)

        def gathers():  # inter-node part first; the message is the gathered output
            for d in range(nd):
                for tier in (True, False):
                    gw = group([f[c]["AG"][d] if inter[c] == tier else None for c in range(C)])
                    if gw is not None:
                        move(gw, d, -1)
                        step(Collective.ALLGATHER, gw, src_dim=d)

        def slices():  # each dimension's slice copies its piece out
            for d in range(nd):
                gw = group([f[c]["slice"][d] for c in range(C)])
                if gw is not None:
                    move(gw, d, 1)
                    check(d)
                    step("slice", gw, dst_dim=d)

        if early_slices:
            slices()
        for d in range(nd):
            check(d)
        if gather_first:
            gathers()
        for d in range(nd):  # reduce-scatters, intra-node part first
            for tier in (False, True):
                gw = group([f[c]["RS"][d] if inter[c] == tier else None for c in range(C)])
                if gw is not None:
                    step(Collective.REDUCESCATTER, gw, dst_dim=d)
                    move(gw, d, 1)
                    check(d)
        gw = group([f[c]["AR"] for c in range(C)])
        if gw is not None:
            step(Collective.ALLREDUCE, gw)
        for i in range(nd):  # all-to-alls
            for j in range(nd):
                if i != j:
                    gw = group([f[c]["A"][(i, j)] for c in range(C)])
                    if gw is not None:
                        step(Collective.ALLTOALL, gw, i, j)
                        move(gw, i, -1)
                        move(gw, j, 1)
                        check(j)
        if not gather_first:
            gathers()
        if not early_slices:
            slices()
        total[bad] = np.nan
        return total

    def _orders(self, shape, src, dst, t: np.ndarray) -> np.ndarray:
        """Pairs (rows of ``src`` and ``dst``) whose first order gave NaN: ``box``'s other orders in turn;
        inf where none divides."""
        for early, gather_first in ((False, False), (False, True)):
            if not np.isnan(t).any():
                break
            k = np.flatnonzero(np.isnan(t))
            t[k] = self._walk(shape, self._counts(src[k], dst[k], len(shape), outer=False), early, gather_first)
        t[np.isnan(t)] = math.inf
        return t

    def cost(self, shape: tuple[int, ...], src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Seconds of boxing a tensor of ``shape`` from ``src`` to ``dst`` row by row (J x A codes; either
        may be one row, broadcast); inf where no order keeps every intermediate evenly divisible."""
        shape = tuple(shape)
        src, dst = np.broadcast_arrays(np.atleast_2d(src), np.atleast_2d(dst))
        if not self.classes:  # one device: nothing moves
            return np.zeros(len(src))
        return self._orders(shape, src, dst, self._walk(shape, self._counts(src, dst, len(shape), outer=False)))

    def table(self, shape: tuple[int, ...], src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Seconds of boxing from every row of ``src`` (n1 x A) to every row of ``dst`` (n2 x A): n1 x n2;
        inf where no order keeps every intermediate evenly divisible."""
        shape, src, dst = tuple(shape), np.atleast_2d(src), np.atleast_2d(dst)
        if not self.classes:  # one device: nothing moves
            return np.zeros((len(src), len(dst)))
        key = None
        if self._tables is not None:
            key = (shape, src.shape, dst.shape, src.tobytes(), dst.tobytes())
            hit = self._tables.get(key)
            if hit is not None:
                return hit
        t = self._walk(shape, self._counts(src, dst, len(shape), outer=True))
        if np.isnan(t).any():
            i, j = np.nonzero(np.isnan(t))
            t[i, j] = self._orders(shape, src[i], dst[j], t[i, j])
        if key is not None:
            t.flags.writeable = False
            self._tables[key] = t
        return t
