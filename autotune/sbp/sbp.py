"""nd-SBP: for each axis of a device mesh one of S(i) (split along tensor
dimension i), B (broadcast: replicated) or P (partial sum), written as in
AutoDDL: ``(S0: 4, B: 2, S1: 8)``, or with several GPUs per node
``(S0: (2, 4), B: (1, 2), S1: (4, 1))`` (nodes, GPUs per node) per axis.

Placements are plain strings "B", "P", "S0", "S1", ... so that they hash and
compare cheaply in the search.

When several mesh axes split the same dimension, the order of the blocks
along it is a layout detail: a distribution is defined by *which* devices hold
*which* index sets (each device holds one equal share per split dimension,
the shares depending only on the coordinates of the splitting axes). The
boxing paths of §4.3 (e.g. reduce-scatter onto axis 2, then all-gather over
axis 1) produce such strided layouts; a plan initialises its parameters in
the matching permutation, as OneFlow's merged ``(S1: p1*p2)`` notation does.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from calibrate.errors import UserError

from autotune.sbp.mesh import Cluster, RoleMesh

B, P = "B", "P"


def S(i: int) -> str:
    return f"S{i}"


def is_split(p: str) -> bool:
    return p[0] == "S"


def split_dim(p: str) -> int:
    return int(p[1:])


def dual(p: str) -> str:
    """The placement of the gradient: S stays S, B becomes P, P becomes B."""
    return P if p == B else B if p == P else p


def check_placement(p: str) -> str:
    if p in (B, P) or (p[:1] == "S" and p[1:].isascii() and p[1:].isdigit()):
        return p
    raise UserError(f"unknown SBP placement {p!r}: use S0, S1, ... (split), B (broadcast) or P (partial sum)")


def local_shape(shape, fine: tuple[str, ...], cluster: Cluster) -> tuple[int, ...]:
    """The shape of one device's piece; a UserError if a split does not divide."""
    out = list(shape)
    for p, size in zip(fine, cluster.axis_sizes):
        if p[0] != "S":
            continue
        d = int(p[1:])
        if d >= len(shape):
            raise UserError(
                f"SBP {p} splits dimension {d} but the tensor has shape {tuple(shape)}: split a dimension below {len(shape)}"
            )
        if out[d] % size:
            raise UserError(
                f"dimension {d} of shape {tuple(shape)} does not divide evenly over the SBP split: "
                f"pick a mesh whose splits of dimension {d} multiply to a divisor of {shape[d]}"
            )
        out[d] //= size
    return tuple(out)


@functools.lru_cache(maxsize=None)
def divides(shape, fine: tuple[str, ...], cluster: Cluster) -> bool:
    """Whether ``local_shape`` has a piece (every split divides its dimension; memoised: a large search asks it
    half a million times of a few thousand shapes)."""
    out = list(shape)
    for p, size in zip(fine, cluster.axis_sizes):
        if p[0] == "S":
            d = int(p[1:])
            if d >= len(out) or out[d] % size:
                return False
            out[d] //= size
    return True


@dataclass(frozen=True)
class NdSbp:
    """One placement per role of a ``RoleMesh``."""

    placements: tuple[str, ...]
    mesh: RoleMesh

    def __post_init__(self):
        if len(self.placements) != len(self.mesh.sizes):
            raise UserError(
                f"SBP has {len(self.placements)} placements for a mesh of {len(self.mesh.sizes)} axes: give one per axis"
            )
        for p in self.placements:
            check_placement(p)

    def fine(self, cluster: Cluster) -> tuple[str, ...]:
        """The placement of each fine axis of ``cluster``."""
        return tuple(self.placements[r] for r in self.mesh.roles_of_axes(cluster))

    def check(self, shape, cluster: Cluster) -> tuple[int, ...]:
        for d in {split_dim(p) for p in self.placements if is_split(p)}:
            if d >= len(shape):
                raise UserError(
                    f"SBP {self.format(cluster)} splits dimension {d} but the tensor has shape {tuple(shape)}: "
                    f"split a dimension below {len(shape)}"
                )
        return local_shape(shape, self.fine(cluster), cluster)

    def format(self, cluster: Cluster) -> str:
        return "(" + ", ".join(f"{p}: {self.mesh.label(cluster, r)}" for r, p in enumerate(self.placements)) + ")"


@functools.lru_cache(maxsize=None)
def fine_of(placements: tuple[str, ...], mesh: RoleMesh, cluster: Cluster) -> tuple[str, ...]:
    """``NdSbp(placements, mesh).fine(cluster)``, checked and made once per argument (a pure function the
    strategies' construction and pricing ask millions of times on a large cluster)."""
    return NdSbp(placements, mesh).fine(cluster)


_ITEM = re.compile(r"\s*(S\d+|B|P)\s*:\s*(\(\s*\d+\s*,\s*\d+\s*\)|\d+)\s*")


def parse(text: str, cluster: Cluster) -> NdSbp:
    """Parse the paper's notation, e.g. ``(S0: 2, B: 4, S1: 8)`` or ``(S0: (2, 4), P: (1, 2))``."""
    body = text.strip()
    if not (body.startswith("(") and body.endswith(")")):
        raise UserError(f"bad SBP {text!r}: write it as (S0: 2, B: 4, S1: 8) or (S0: (nodes, gpus), ...)")
    body = body[1:-1]
    items, pos = [], 0
    while pos < len(body):
        m = _ITEM.match(body, pos)
        if not m:
            raise UserError(f"bad SBP {text!r} near {body[pos:]!r}: write entries as PLACEMENT: SIZE")
        items.append(m.groups())
        pos = m.end()
        if pos < len(body):
            if body[pos] != ",":
                raise UserError(f"bad SBP {text!r}: separate entries with commas")
            pos += 1
    sizes = []
    for _, size in items:
        if size.startswith("("):
            n, g = (int(x) for x in size.strip("() ").split(","))
        elif cluster.gpus_per_node == 1:
            n, g = int(size), 1
        else:
            raise UserError(
                f"SBP {text!r} gives a plain size on a cluster with {cluster.gpus_per_node} GPUs per node: "
                f"write each size as (nodes, gpus)"
            )
        sizes.append((n, g))
    mesh = RoleMesh(tuple(sizes))
    if math.prod(n * g for n, g in sizes) != cluster.devices:
        raise UserError(
            f"SBP {text!r} spans {math.prod(n * g for n, g in sizes)} devices but the cluster has {cluster.devices}: "
            f"make the axis sizes multiply to {cluster.devices}"
        )
    mesh.roles_of_axes(cluster)
    return NdSbp(tuple(p for p, _ in items), mesh)
