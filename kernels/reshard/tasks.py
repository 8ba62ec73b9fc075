"""Decomposing a cross-mesh resharding task into unit communication tasks (§2.2).

A unit task is one piece of the tensor that is a unique source slice intersected
with a unique destination tile: the source devices that hold it (any of them may
send) and the destination devices that need it. Unique source slices partition
the tensor and so do unique destination tiles, so the unit tasks partition it
too. This is the count the paper gives for Table 2 (case 4: 8 source slices x 8
destination tiles = 64). Figure 2's "Task 2" counts source slices instead; we
follow the Table 2 reading, which lets every receiver get exactly what it needs.

Unit tasks are ordered by destination tile, then source slice (Alpa's order,
which the naive solver keeps).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.reshard.spec import Box, Mesh, ShardingSpec, box_volume, intersect
from calibrate.errors import UserError


@dataclass(frozen=True)
class ReshardTask:
    """One cross-mesh resharding task: a tensor moved from (src mesh, src spec) to (dst mesh, dst spec)."""

    shape: tuple[int, ...]
    dtype: str
    src_mesh: Mesh
    src_spec: ShardingSpec
    dst_mesh: Mesh
    dst_spec: ShardingSpec

    def __post_init__(self):
        if not self.shape or any(n < 1 for n in self.shape):
            raise UserError(f"tensor shape {self.shape} must have positive sizes, e.g. 1024,1024,512")
        try:
            np.dtype(self.dtype)
        except TypeError:
            raise UserError(f"unknown dtype {self.dtype!r}: use e.g. float32 or float16") from None
        if self.src_mesh.devices_per_host != self.dst_mesh.devices_per_host:
            raise UserError("source and destination meshes disagree on devices per host: use one cluster")
        self.src_spec.check(self.shape, self.src_mesh, "source spec")
        self.dst_spec.check(self.shape, self.dst_mesh, "destination spec")

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def devices_per_host(self) -> int:
        return self.src_mesh.devices_per_host

    def host(self, device: int) -> int:
        return device // self.devices_per_host

    @property
    def ranks_needed(self) -> int:
        """Ranks of a job that runs it with device id = rank."""
        return max(self.src_mesh.devices + self.dst_mesh.devices) + 1

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype,
                "src_mesh": self.src_mesh.to_dict(), "src_spec": str(self.src_spec),
                "dst_mesh": self.dst_mesh.to_dict(), "dst_spec": str(self.dst_spec)}

    @classmethod
    def from_dict(cls, d: dict) -> "ReshardTask":
        return cls(tuple(d["shape"]), d["dtype"], Mesh.from_dict(d["src_mesh"]),
                   ShardingSpec.parse(d["src_spec"]), Mesh.from_dict(d["dst_mesh"]),
                   ShardingSpec.parse(d["dst_spec"]))

    def src_tiles(self) -> dict[int, Box]:
        return self.src_spec.tiles(self.shape, self.src_mesh)

    def dst_tiles(self) -> dict[int, Box]:
        return self.dst_spec.tiles(self.shape, self.dst_mesh)


@dataclass(frozen=True)
class UnitTask:
    index: int
    box: Box
    senders: tuple[int, ...]    # devices holding the slice
    receivers: tuple[int, ...]  # devices needing it
    nbytes: int

    def to_dict(self) -> dict:
        return {"index": self.index, "box": [list(b) for b in self.box], "senders": list(self.senders),
                "receivers": list(self.receivers), "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: dict) -> "UnitTask":
        return cls(d["index"], tuple(tuple(b) for b in d["box"]), tuple(d["senders"]),
                   tuple(d["receivers"]), d["nbytes"])


def _unique(tiles: dict[int, Box]) -> list[tuple[Box, tuple[int, ...]]]:
    groups: dict[Box, list[int]] = {}
    for dev, box in tiles.items():
        if box_volume(box) > 0:
            groups.setdefault(box, []).append(dev)
    return [(box, tuple(devs)) for box, devs in groups.items()]


def unit_tasks(task: ReshardTask) -> list[UnitTask]:
    out = []
    src = _unique(task.src_tiles())
    for dbox, receivers in _unique(task.dst_tiles()):
        for sbox, senders in src:
            piece = intersect(sbox, dbox)
            if piece is not None:
                out.append(UnitTask(len(out), piece, senders, receivers, box_volume(piece) * task.itemsize))
    return out
