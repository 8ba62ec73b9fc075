"""Clusters and hierarchical device meshes.

A cluster is ``nodes`` x ``gpus_per_node`` devices, rank = node * gpus_per_node + gpu.
It is cut into *fine axes*: the prime factors of the node count (inter-node
axes, major) followed by the prime factors of the GPUs per node (intra-node
axes). A device's coordinate on each fine axis is its mixed-radix digit.

A layer's mesh (``RoleMesh``) has a few *roles* (the paper's p0, p1, p2); each
role is a tuple (nodes, gpus) as in AutoDDL §4.2.3, e.g. (S0: (2, 4), ...).
Role r owns a contiguous run of the node axes and a contiguous run of the GPU
axes, roles in order, so that two layers whose role sizes agree share the same
fine axes, which is what makes the paper's boxing paths of §4.3 line up. With
contiguous runs, every tuple of role sizes is reachable when the counts are
powers of a prime; for other counts some orders of factors are not (the error
says which are).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

from calibrate.errors import OptionError, UserError
from calibrate.profile import Group


def prime_factors(n: int) -> tuple[int, ...]:
    out, d = [], 2
    while d * d <= n:
        while n % d == 0:
            out.append(d)
            n //= d
        d += 1
    if n > 1:
        out.append(n)
    return tuple(out)


def cached_hash(cls):
    """A frozen dataclass whose hash (its fields' tuple's, as the dataclass makes it) is computed once per object:
    strategies, their tensors and meshes key the searches' memoised figures, and hashing their nested tuples again
    at every lookup was a tenth of a large search's time. The cached value is not pickled (string hashes differ
    between processes)."""
    raw = cls.__hash__

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = raw(self)
            object.__setattr__(self, "_hash", h)  # frozen: set as functools.cached_property sets
        return h

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}
    cls.__hash__, cls.__getstate__ = __hash__, __getstate__
    return cls


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise OptionError(
                "nodes", f"{self.nodes} x {{gpus_per_node}} {self.gpus_per_node}: both must be at least 1")

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @cached_property
    def node_axes(self) -> tuple[int, ...]:
        return prime_factors(self.nodes)

    @cached_property
    def gpu_axes(self) -> tuple[int, ...]:
        return prime_factors(self.gpus_per_node)

    @cached_property
    def axis_sizes(self) -> tuple[int, ...]:
        return self.node_axes + self.gpu_axes

    @cached_property
    def axis_inter(self) -> tuple[bool, ...]:
        return (True,) * len(self.node_axes) + (False,) * len(self.gpu_axes)

    def group(self, axes) -> Group:
        """The communicator spanned by fine ``axes`` (its ranks and how many nodes they cover)."""
        ranks = nodes = 1
        for a in axes:
            ranks *= self.axis_sizes[a]
            if self.axis_inter[a]:
                nodes *= self.axis_sizes[a]
        return Group(ranks, nodes)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Fine-axis coordinates of ``rank`` (mixed radix, first axis most significant)."""
        out = []
        for size in reversed(self.axis_sizes):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def __str__(self) -> str:
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node} GPU{'s' if self.gpus_per_node > 1 else ''}"


def _runs(axes: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    """Split ``axes`` (their sizes) into contiguous runs whose products are ``sizes``."""
    out, i = [], 0
    for s in sizes:
        run, prod = [], 1
        while prod < s and i < len(axes):
            prod *= axes[i]
            run.append(i)
            i += 1
        if prod != s:
            return None
        out.append(tuple(run))
    return tuple(out) if i == len(axes) else None


@cached_hash
@dataclass(frozen=True)
class RoleMesh:
    """Role sizes, each (nodes, gpus); the product over roles is the cluster."""

    sizes: tuple[tuple[int, int], ...]

    def role_size(self, r: int) -> int:
        return self.sizes[r][0] * self.sizes[r][1]

    def roles_of_axes(self, cluster: Cluster) -> tuple[int, ...]:
        """The role of each fine axis of ``cluster``."""
        return _roles_of_axes(self, cluster)

    def label(self, cluster: Cluster, r: int) -> str:
        n, g = self.sizes[r]
        return str(n * g) if cluster.gpus_per_node == 1 else f"({n}, {g})"


_ROLE_CACHE: dict = {}


def _roles_of_axes(mesh: RoleMesh, cluster: Cluster) -> tuple[int, ...]:
    key = (mesh, cluster)
    hit = _ROLE_CACHE.get(key)
    if hit is not None:
        return hit
    if math.prod(n for n, _ in mesh.sizes) != cluster.nodes or math.prod(g for _, g in mesh.sizes) != cluster.gpus_per_node:
        raise UserError(
            f"mesh {[list(s) for s in mesh.sizes]} does not match the cluster {cluster}: the node parts must "
            f"multiply to {cluster.nodes} and the GPU parts to {cluster.gpus_per_node}"
        )
    node_runs = _runs(cluster.node_axes, tuple(n for n, _ in mesh.sizes))
    gpu_runs = _runs(cluster.gpu_axes, tuple(g for _, g in mesh.sizes))
    if node_runs is None or gpu_runs is None:
        raise UserError(
            f"mesh {[list(s) for s in mesh.sizes]} cannot be laid out on {cluster}: role sizes must follow the "
            f"prime factors in order (nodes {list(cluster.node_axes)}, GPUs {list(cluster.gpu_axes)}); reorder the roles"
        )
    roles = [0] * len(cluster.axis_sizes)
    off = len(cluster.node_axes)
    for r, run in enumerate(node_runs):
        for i in run:
            roles[i] = r
    for r, run in enumerate(gpu_runs):
        for i in run:
            roles[off + i] = r
    out = tuple(roles)
    _ROLE_CACHE[key] = out
    return out


def _prefix_products(axes: tuple[int, ...], k: int) -> list[tuple[int, ...]]:
    """All ways to cut ``axes`` into k contiguous runs, as the runs' products."""
    n = len(axes)
    out = []
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        bounds = (0,) + cuts + (n,)
        out.append(tuple(math.prod(axes[bounds[i]:bounds[i + 1]]) for i in range(k)))
    return sorted(set(out))


def role_meshes(cluster: Cluster, k: int) -> list[RoleMesh]:
    """Every k-role mesh that can be laid out on ``cluster``."""
    nodes = _prefix_products(cluster.node_axes, k)
    gpus = _prefix_products(cluster.gpu_axes, k)
    return [RoleMesh(tuple(zip(n, g))) for n in nodes for g in gpus]
