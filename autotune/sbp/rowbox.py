"""Boxing costs of many redistributions at once: numpy over rows of (source, destination) placements.

A coordinate-descent line search needs the cost of boxing one producer's
output into every strategy of its consumer (a row of a boxing table), and the
reverse; GPT-3 on 4,096 GPUs has ~1,000 strategies a layer, too many to walk
``autotune.sbp.boxing.box`` one pair at a time. ``RowBoxer.cost`` follows the
same path as ``box`` (its first order: free slices, reduce-scatters intra-node
part first, one all-reduce, all-to-alls, all-gathers inter-node part first),
with the placements coded as integers per fine axis (S(d) -> d, B -> -1,
P -> -2), every phase a mask over the axes and every message size a product
over them. Rows where an intermediate of that order does not divide evenly
are returned as NaN: the caller boxes them one by one with ``box``, which
tries the other orders. Equal to ``box`` to rounding: tested on every pair of
small problems.

Complexity: O(J x A x D) array work for J rows, A fine axes, D tensor
dimensions, plus one profile lookup per distinct (collective, bytes, group).
"""
from __future__ import annotations

import numpy as np

from calibrate.collectives import Collective

from autotune.sbp.boxing import Coster

CODE_B, CODE_P = -1, -2


def encode(fine: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(CODE_B if p == "B" else CODE_P if p == "P" else int(p[1:]) for p in fine)


def dual_code(codes: np.ndarray) -> np.ndarray:
    """B <-> P, S stays (the gradient's placement)."""
    return np.where(codes == CODE_B, CODE_P, np.where(codes == CODE_P, CODE_B, codes))


class RowBoxer:
    def __init__(self, coster: Coster, itemsize: int):
        self.coster, self.itemsize = coster, itemsize
        cl = coster.cluster
        self.z = np.array(cl.axis_sizes, dtype=np.int64)
        self.inter = np.array(cl.axis_inter, dtype=bool)
        self._memo: dict = {}

    def _times(self, op: Collective, nbytes: np.ndarray, ranks: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        """Profile times of one step per row (0 where ranks == 1: no step)."""
        out = np.zeros(len(nbytes))
        live = ranks > 1
        if not live.any():
            return out
        idx = np.flatnonzero(live)
        grp = ranks[idx] * (1 << 20) + nodes[idx]  # a group: ranks and nodes (each below 2^20)
        coster = self.coster
        for g in np.unique(grp):
            sel = idx[grp == g]
            r, n = int(g) >> 20, int(g) & ((1 << 20) - 1)
            uniq, inv = np.unique(nbytes[sel], return_inverse=True)
            vals = np.empty(len(uniq))
            for k, nb in enumerate(uniq.tolist()):
                key = (op, nb, r, n)
                t = self._memo.get(key)
                if t is None:
                    t = self._memo[key] = coster.group_time(op, nb, r, n)
                vals[k] = t
            out[sel] = vals[inv.ravel()]
        return out

    def cost(self, shape: tuple[int, ...], src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Seconds of boxing a tensor of ``shape`` from ``src`` to ``dst`` (J x A codes; either may be one
        row, broadcast); NaN where the first path order does not divide evenly."""
        src, dst = np.broadcast_arrays(np.atleast_2d(src), np.atleast_2d(dst))
        cur = src.copy()
        dst = np.asarray(dst)
        J = cur.shape[0]
        z, inter = self.z, self.inter
        dims = np.array(shape, dtype=np.int64)
        nd = len(shape)
        bad = np.zeros(J, dtype=bool)
        total = np.zeros(J)

        def divisors(c):  # (J, D): product of the axis sizes splitting each dimension
            return np.stack([np.where(c == d, z, 1).prod(axis=1) for d in range(nd)], axis=1)

        def local(c):  # elements of one device's piece; marks rows that do not divide
            div = divisors(c)
            ok = (dims % div == 0).all(axis=1)
            bad[~ok] = True
            return (dims // div).prod(axis=1)

        def group(mask):
            return np.where(mask, z, 1).prod(axis=1), np.where(mask & inter, z, 1).prod(axis=1)

        def step(op, mask, nbytes):
            ranks, nodes = group(mask)
            total[:] += self._times(op, nbytes, ranks, nodes)

        # free slices (B -> S), per dimension
        for d in range(nd):
            m = (cur == CODE_B) & (dst == d)
            if m.any():
                cur[m] = d
                local(cur)
        # reduce-scatters P -> S(d): per dimension, the intra-node part first
        rs = (cur == CODE_P) & (dst >= 0)
        for d in range(nd):
            for tier in (~inter, inter):
                m = rs & (dst == d) & tier
                if m.any():
                    nb = local(cur) * self.itemsize
                    cur[m] = d
                    local(cur)
                    step(Collective.REDUCESCATTER, m, nb)
        # one all-reduce P -> B
        m = (cur == CODE_P) & (dst == CODE_B)
        if m.any():
            nb = local(cur) * self.itemsize
            step(Collective.ALLREDUCE, m, nb)
            cur[m] = CODE_B
            local(cur)
        # all-to-alls S(i) -> S(j), per (i, j)
        a2a = (cur >= 0) & (dst >= 0) & (cur != dst)
        pairs = [(i, j) for i in range(nd) for j in range(nd) if i != j]
        masks = [a2a & (cur == i) & (dst == j) for i, j in pairs]
        for (i, j), m in zip(pairs, masks):
            if m.any():
                nb = local(cur) * self.itemsize
                cur[m] = j
                local(cur)
                step(Collective.ALLTOALL, m, nb)
        # all-gathers S(d) -> B or P: per dimension, the inter-node part first
        ag = (cur >= 0) & (dst < 0)
        for d in range(nd):
            for tier in (inter, ~inter):
                m = ag & (cur == d) & tier
                if m.any():
                    cur[m] = CODE_B
                    nb = local(cur) * self.itemsize
                    step(Collective.ALLGATHER, m, nb)
        total[bad] = np.nan
        return total
