"""A numpy simulation of a distributed tensor, to check boxing paths.

Every device holds a local array and, per tensor dimension, the global
indices of its rows along that dimension. ``execute`` runs boxing steps as
real data movement between the devices of each group (sums, concatenations,
chunking), and ``check`` verifies that the result *is* the target
distribution: per dimension the index sets depend only on the coordinates of
the axes that split it and partition the dimension evenly, and each device's
data (summed over the partial-sum axes) equals the global tensor at its indices.
"""
from __future__ import annotations

import itertools

import numpy as np

from autotune.sbp.boxing import Step
from autotune.sbp.mesh import Cluster
from autotune.sbp.sbp import P, is_split, split_dim


class DistTensor:
    def __init__(self, cluster: Cluster, data: list[np.ndarray], idx: list[list[np.ndarray]]):
        self.cluster = cluster
        self.data = data
        self.idx = idx

    @classmethod
    def scatter(cls, x: np.ndarray, fine: tuple[str, ...], cluster: Cluster, rng: np.random.Generator) -> "DistTensor":
        """Distribute ``x`` as ``fine`` (blocks nested in axis order), partial sums random."""
        coords = [cluster.coords(r) for r in range(cluster.devices)]
        idx = []
        for c in coords:
            per_dim = []
            for d, n in enumerate(x.shape):
                block, count = 0, 1
                for a, p in enumerate(fine):
                    if is_split(p) and split_dim(p) == d:
                        block = block * cluster.axis_sizes[a] + c[a]
                        count *= cluster.axis_sizes[a]
                size = n // count
                per_dim.append(np.arange(block * size, (block + 1) * size))
            idx.append(per_dim)
        data = [x[np.ix_(*ix)].astype(float) for ix in idx]
        p_axes = [a for a, p in enumerate(fine) if p == P]
        if p_axes:
            for r, c in enumerate(coords):
                if any(c[a] for a in p_axes):
                    noise = rng.standard_normal(data[r].shape)
                    data[r] = noise
            for r, c in enumerate(coords):
                if not any(c[a] for a in p_axes):
                    others = [q for q, cq in enumerate(coords) if q != r and all(
                        cq[a] == c[a] for a in range(len(c)) if a not in p_axes)]
                    data[r] = data[r] - sum(data[q] for q in others)
        return cls(cluster, data, idx)

    def groups(self, axes: tuple[int, ...]) -> list[list[int]]:
        """Ranks grouped by their coordinates off ``axes``, ordered by their coordinates on ``axes``."""
        coords = [self.cluster.coords(r) for r in range(self.cluster.devices)]
        out: dict = {}
        for r, c in enumerate(coords):
            key = tuple(v for a, v in enumerate(c) if a not in axes)
            out.setdefault(key, []).append(r)
        for members in out.values():
            members.sort(key=lambda r: tuple(coords[r][a] for a in axes))
        return list(out.values())

    def execute(self, steps) -> "DistTensor":
        for step in steps:
            self._step(step)
        return self

    def _step(self, st: Step):
        for g in self.groups(st.axes):
            p = len(g)
            if st.op == "allreduce":
                total = sum(self.data[r] for r in g)
                for r in g:
                    self.data[r] = total.copy()
            elif st.op == "reducescatter":
                total = sum(self.data[r] for r in g)
                for k, r in enumerate(g):
                    self.data[r] = np.array_split(total, p, axis=st.dst_dim)[k]
                    self.idx[r][st.dst_dim] = np.array_split(self.idx[r][st.dst_dim], p)[k]
            elif st.op == "allgather":
                cat = np.concatenate([self.data[r] for r in g], axis=st.src_dim)
                ix = np.concatenate([self.idx[r][st.src_dim] for r in g])
                for r in g:
                    self.data[r] = cat.copy()
                    self.idx[r][st.src_dim] = ix.copy()
            elif st.op == "alltoall":
                i, j = st.src_dim, st.dst_dim
                pieces = [np.array_split(self.data[r], p, axis=j) for r in g]
                ix_i = np.concatenate([self.idx[r][i] for r in g])
                new = [np.concatenate([pieces[k][t] for k in range(p)], axis=i) for t in range(p)]
                for t, r in enumerate(g):
                    self.data[r] = new[t]
                    self.idx[r][j] = np.array_split(self.idx[r][j], p)[t]
                    self.idx[r][i] = ix_i.copy()
            elif st.op == "slice":
                for k, r in enumerate(g):
                    self.data[r] = np.array_split(self.data[r], p, axis=st.dst_dim)[k]
                    self.idx[r][st.dst_dim] = np.array_split(self.idx[r][st.dst_dim], p)[k]
            elif st.op == "zero":
                for k, r in enumerate(g):
                    if k:
                        self.data[r] = np.zeros_like(self.data[r])
            else:
                raise ValueError(f"unknown step {st.op}")

    def check(self, x: np.ndarray, fine: tuple[str, ...]) -> list[str]:
        """Problems that keep this from being ``x`` distributed as ``fine`` (empty: it is)."""
        cl = self.cluster
        coords = [cl.coords(r) for r in range(cl.devices)]
        problems = []
        for d, n in enumerate(x.shape):
            split_axes = [a for a, p in enumerate(fine) if is_split(p) and split_dim(p) == d]
            count = int(np.prod([cl.axis_sizes[a] for a in split_axes])) if split_axes else 1
            by_key: dict = {}
            for r, c in enumerate(coords):
                key = tuple(c[a] for a in split_axes)
                s = tuple(sorted(self.idx[r][d].tolist()))
                if by_key.setdefault(key, s) != s:
                    problems.append(f"dim {d}: devices with the same split coordinates {key} hold different indices")
            allidx = sorted(itertools.chain.from_iterable(by_key.values()))
            if allidx != list(range(n)) or any(len(s) != n // count for s in by_key.values()):
                problems.append(f"dim {d}: index sets do not partition {n} evenly into {count} shares")
        p_axes = [a for a, p in enumerate(fine) if p == P]
        for g in self.groups(tuple(p_axes)):
            ref = self.idx[g[0]]
            if any(any(not np.array_equal(self.idx[r][d], ref[d]) for d in range(x.ndim)) for r in g):
                problems.append("partial-sum group members hold different index orders")
                continue
            total = sum(self.data[r] for r in g)
            if not np.allclose(total, x[np.ix_(*ref)]):
                problems.append(f"ranks {g}: values differ from the global tensor")
        return problems
