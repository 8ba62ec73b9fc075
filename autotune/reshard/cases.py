"""Resharding tasks: the paper's Table 2 microbenchmark cases (``presets/cases.json``),
explicit meshes, and scenarios written as ``SRCSPEC@H,D[devices]:DSTSPEC@H,D[devices][+shared]``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from calibrate.errors import UserError
from kernels.reshard.spec import Mesh, ShardingSpec, parse_mesh_shape
from kernels.reshard.tasks import ReshardTask


@dataclass(frozen=True)
class Case:
    name: str
    task: ReshardTask
    paper_speedup: float | None  # ours vs the all-gather baseline, as the paper reports it


def _preset() -> dict:
    return json.loads(resources.files("autotune.reshard.presets").joinpath("cases.json").read_text())


def case_profile() -> str:
    """The profile of the paper's cluster (assumed: 4 V100 per host on NVLink, 10 Gb/s between hosts)."""
    return _preset()["profile"]


def case_names() -> list[str]:
    return list(_preset()["cases"])


def build_task(src_mesh: tuple[int, int], src_spec: str, dst_mesh: tuple[int, int], dst_spec: str,
               shape: tuple[int, ...], dtype: str, devices_per_host: int, shared: bool = False) -> ReshardTask:
    """Source mesh on hosts 0.., destination on the next hosts (or on the same devices if ``shared``)."""
    src = Mesh.place(src_mesh, 0, devices_per_host)
    dst = Mesh.place(dst_mesh, 0 if shared else src_mesh[0], devices_per_host)
    return ReshardTask(tuple(shape), dtype, src, ShardingSpec.parse(src_spec), dst, ShardingSpec.parse(dst_spec))


def load_case(name: str | int, devices_per_host: int = 4) -> Case:
    preset = _preset()
    c = preset["cases"].get(str(name))
    if c is None:
        raise UserError(f"unknown case {name!r}: choose one of {', '.join(preset['cases'])}")
    task = build_task(tuple(c["src_mesh"]), c["src_spec"], tuple(c["dst_mesh"]), c["dst_spec"],
                      tuple(preset["shape"]), preset["dtype"], devices_per_host)
    return Case(str(name), task, preset["paper_speedup_vs_allgather"].get(str(name)))


def _side(text: str, devices_per_host: int, first_host: int) -> tuple[str, Mesh]:
    """``SPEC@H,D`` (placed from ``first_host``) or ``SPEC@H,D[d0,d1,...]`` (explicit device ids)."""
    spec, mesh = text.split("@")
    if "[" in mesh:
        shape, devs = mesh.rstrip("]").split("[")
        devices = tuple(int(d) for d in devs.split(",") if d.strip())
        return spec, Mesh(parse_mesh_shape(shape), devices, devices_per_host)
    return spec, Mesh.place(parse_mesh_shape(mesh), first_host, devices_per_host)


def parse_scenario(text: str, shape, dtype: str, devices_per_host: int) -> ReshardTask:
    """``SRCSPEC@H,D:DSTSPEC@H,D``: the destination on the hosts after the source, or on the source's
    devices with ``+shared``; either side may list its devices, ``SPEC@H,D[d0,d1,...]``."""
    shared = text.endswith("+shared")
    body = text[:-len("+shared")] if shared else text
    try:
        src, dst = body.split(":")
        sspec, smesh = _side(src, devices_per_host, 0)
        dspec, dmesh = _side(dst, devices_per_host, 0 if shared else smesh.shape[0])
    except ValueError:
        raise UserError(f"scenario {text!r} is not SRCSPEC@H,D[devices]:DSTSPEC@H,D[devices][+shared], "
                        f"e.g. S0RR@2,2:RRR@2,2") from None
    return ReshardTask(tuple(shape), dtype, smesh, ShardingSpec.parse(sspec), dmesh, ShardingSpec.parse(dspec))
