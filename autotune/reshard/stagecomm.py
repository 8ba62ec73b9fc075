"""Pipelines from presets: compute times from the preset, the communication of
each stage boundary and skip connection from resharding plans of its tensors on
a profile."""
from __future__ import annotations

from autotune.reshard.cases import build_task
from autotune.reshard.pipeline import PipelineSpec, Skip, load_pipelines
from autotune.reshard.plan import make_plan
from autotune.reshard.solvers import SolverConfig
from calibrate.errors import UserError
from calibrate.profile import Profile


def boundary_time(tensors: list[dict], src_mesh, dst_mesh, dtype: str, profile: Profile,
                  cfg: SolverConfig, reverse: bool = False) -> float:
    """Seconds to reshard a boundary's tensors one after the other (broadcast, ensemble)."""
    dph = int(profile.hardware.get("gpus_per_node") or max(src_mesh[1], dst_mesh[1]))
    total = 0.0
    for t in tensors:
        a, b = (t["dst_spec"], t["src_spec"]) if reverse else (t["src_spec"], t["dst_spec"])
        ma, mb = (dst_mesh, src_mesh) if reverse else (src_mesh, dst_mesh)
        task = build_task(tuple(ma), a, tuple(mb), b, tuple(t["shape"]), dtype, dph)
        total += make_plan(task, profile, "broadcast", "ensemble", cfg).makespan
    return total


def pipeline_from_preset(name: str, profile: Profile, micro_batches: int | None = None,
                         cfg: SolverConfig = SolverConfig(time_budget=0.2)) -> PipelineSpec:
    presets = load_pipelines()["pipelines"]
    if name not in presets:
        raise UserError(f"unknown pipeline {name!r}: choose one of {', '.join(presets)}")
    p = presets[name]
    meshes = p["meshes"]

    def both(tensors, a, b):
        return (boundary_time(tensors, meshes[a], meshes[b], p["dtype"], profile, cfg),
                boundary_time(tensors, meshes[a], meshes[b], p["dtype"], profile, cfg, reverse=True))

    bounds = [both(b, i, i + 1) for i, b in enumerate(p["boundaries"])]
    skips = tuple(Skip(k["src"], k["dst"], *both(k["tensors"], k["src"], k["dst"])) for k in p.get("skips", []))
    return PipelineSpec(name, int(micro_batches or p["micro_batches"]), tuple(p["forward"]), tuple(p["backward"]),
                        tuple(f for f, _ in bounds), tuple(b for _, b in bounds), tuple(p["activation_bytes"]),
                        skips)
