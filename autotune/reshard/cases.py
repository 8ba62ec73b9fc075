"""The paper's Table 2 microbenchmark cases, read from ``presets/cases.json``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from autotune.reshard.spec import Mesh, ShardingSpec
from autotune.reshard.tasks import ReshardTask
from calibrate.errors import UserError


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
