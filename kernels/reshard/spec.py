"""Device meshes and sharding specs in the paper's notation (§2.2).

A mesh is a 2D view (m1, m2) of devices: rows are hosts, columns the devices of
a host. A sharding spec has one entry per tensor dimension: ``R`` (replicated),
``S0`` / ``S1`` (sharded along mesh axis 0 / 1) or ``S01`` (sharded along both,
axis 0 major). Uneven dimensions are padded: a dimension of size n split k ways
gets shards of ceil(n/k) elements, the last ones clipped at n.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from calibrate.errors import OptionError, UserError

Box = tuple[tuple[int, int], ...]  # per tensor dimension: [lo, hi)

_TOKEN = re.compile(r"S\^?_?\{?(01|0|1)\}?|R")


@dataclass(frozen=True)
class Mesh:
    """``shape`` = (hosts, devices per host used); ``devices`` row-major global device ids."""

    shape: tuple[int, int]
    devices: tuple[int, ...]
    devices_per_host: int

    def __post_init__(self):
        m1, m2 = self.shape
        if m1 < 1 or m2 < 1:
            raise UserError(f"mesh shape {self.shape} must be positive: give it as hosts,devices e.g. 2,4")
        if len(self.devices) != m1 * m2:
            raise UserError(
                f"mesh {m1}x{m2} needs {m1 * m2} devices but {len(self.devices)} were given: "
                f"list exactly {m1 * m2} device ids"
            )
        if len(set(self.devices)) != len(self.devices):
            raise UserError(f"mesh devices {list(self.devices)} repeat a device: list each device once")

    @classmethod
    def place(cls, shape: tuple[int, int], first_host: int, devices_per_host: int) -> "Mesh":
        """Row r of the mesh on host first_host + r, its columns on that host's first devices."""
        m1, m2 = shape
        if m2 > devices_per_host:
            raise OptionError(
                "devices_per_host", f"{devices_per_host}: mesh {m1}x{m2} needs {m2} devices per host; use at most "
                                    f"{devices_per_host} columns or set it")
        devs = tuple((first_host + r) * devices_per_host + c for r in range(m1) for c in range(m2))
        return cls((m1, m2), devs, devices_per_host)

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def host(self, device: int) -> int:
        return device // self.devices_per_host

    @property
    def hosts(self) -> tuple[int, ...]:
        return tuple(sorted({self.host(d) for d in self.devices}))

    def coords(self):
        """(row, col, device) for every device, row-major."""
        m2 = self.shape[1]
        for i, d in enumerate(self.devices):
            yield i // m2, i % m2, d

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "devices": list(self.devices),
                "devices_per_host": self.devices_per_host}

    @classmethod
    def from_dict(cls, d: dict) -> "Mesh":
        return cls(tuple(d["shape"]), tuple(d["devices"]), int(d["devices_per_host"]))


def parse_mesh_shape(text: str) -> tuple[int, int]:
    parts = [p for p in re.split(r"[,x× ]+", text.strip().strip("()")) if p]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise UserError(f"mesh shape {text!r} is not two integers: write it as hosts,devices e.g. 2,4")
    return int(parts[0]), int(parts[1])


@dataclass(frozen=True)
class ShardingSpec:
    """Per tensor dimension: () for R, else the mesh axes it is sharded along."""

    dims: tuple[tuple[int, ...], ...]

    @classmethod
    def parse(cls, text: str) -> "ShardingSpec":
        s = text.replace(" ", "").replace("$", "").replace("{", "").replace("}", "")
        dims, pos = [], 0
        while pos < len(s):
            m = _TOKEN.match(s, pos)
            if not m:
                raise UserError(
                    f"sharding spec {text!r} is not understood at {s[pos:]!r}: write one of R, S0, S1, "
                    f"S01 per tensor dimension, e.g. S0RR"
                )
            dims.append(() if m.group(0) == "R" else tuple(int(c) for c in m.group(1)))
            pos = m.end()
        if not dims:
            raise UserError("empty sharding spec: write one of R, S0, S1, S01 per tensor dimension, e.g. S0RR")
        used = [a for d in dims for a in d]
        if len(used) != len(set(used)):
            raise UserError(f"sharding spec {text!r} uses a mesh axis twice: shard each mesh axis at most once")
        return cls(tuple(dims))

    def __str__(self) -> str:
        return "".join("R" if not d else "S" + "".join(map(str, d)) for d in self.dims)

    def shards(self, mesh: Mesh, dim: int) -> int:
        return math.prod(mesh.shape[a] for a in self.dims[dim])

    def shard_index(self, mesh: Mesh, dim: int, row: int, col: int) -> int:
        idx = 0
        for a in self.dims[dim]:
            idx = idx * mesh.shape[a] + (row if a == 0 else col)
        return idx

    def check(self, shape: tuple[int, ...], mesh: Mesh, what: str = "spec") -> None:
        if len(self.dims) != len(shape):
            raise UserError(
                f"{what} {self} has {len(self.dims)} dimensions but the tensor {tuple(shape)} has "
                f"{len(shape)}: give one entry (R, S0, S1, S01) per tensor dimension"
            )
        for i, n in enumerate(shape):
            k = self.shards(mesh, i)
            if k > n:
                raise UserError(
                    f"{what} {self} splits dimension {i} (size {n}) into {k} shards on mesh "
                    f"{mesh.shape[0]}x{mesh.shape[1]}: that is finer than the dimension allows; "
                    f"replicate it or use a smaller mesh"
                )

    def tiles(self, shape: tuple[int, ...], mesh: Mesh) -> dict[int, Box]:
        """The box of the tensor held by each device of the mesh (padding clipped)."""
        self.check(shape, mesh)
        out = {}
        for row, col, dev in mesh.coords():
            box = []
            for i, n in enumerate(shape):
                k = self.shards(mesh, i)
                size = -(-n // k)
                j = self.shard_index(mesh, i, row, col)
                box.append((min(j * size, n), min((j + 1) * size, n)))
            out[dev] = tuple(box)
        return out


def box_volume(box: Box) -> int:
    return math.prod(max(hi - lo, 0) for lo, hi in box)


def intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(al, bl), min(ah, bh)) for (al, ah), (bl, bh) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def local_slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """Slices selecting ``box`` inside an array that holds ``origin``."""
    return tuple(slice(lo - olo, hi - olo) for (lo, hi), (olo, _) in zip(box, origin))


def contiguous(box: Box, origin: Box) -> bool:
    """Whether ``box`` is one contiguous run of the C-ordered tile that holds ``origin``: every dimension
    after the last partial one full, every one before it of extent 1."""
    ext = [hi - lo for lo, hi in box]
    full = [hi - lo for lo, hi in origin]
    partial = [i for i, (e, f) in enumerate(zip(ext, full)) if e != f]
    return not partial or all(e == 1 for e in ext[:partial[-1]])
