"""Execute one plan on the launched processes through ``autotune.apply``: check it fits them, build the
module, train K steps, and return the measured figures beside the plan's predictions (a versioned record)."""
from __future__ import annotations

import gc
import platform
from dataclasses import replace

from calibrate.errors import OptionError, UserError
from models.hf import DEFAULT_MODULE

from autotune.execute.env import Dist
from autotune.execute.launch import check_steps
from autotune.execute.moduletrain import ModuleTrainer, build_module, torch
from autotune.execute.planread import check_apply_path
from autotune.execute.result import KIND, VERSION
from autotune.plan.typed import ModelSpec, Plan
from autotune.sbp.mesh import Cluster

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
PREDICTED = ("step_s", "compute_s", "exposed_comm_s", "total_s", "redistribution_s", "grad_sync_s", "memory_bytes")


def plan_cluster(plan: Plan, world: int) -> Cluster:
    cluster = plan.cluster
    if cluster.devices != world:
        raise UserError(
            f"the plan {plan.strategy!r} is for {cluster} = {cluster.devices} devices but {world} processes "
            f"were launched: launch {cluster.devices} (e.g. torchrun --nproc-per-node {cluster.devices}) or search "
            f"a plan with --nodes/--gpus-per-node for {world}")
    return cluster


def module_dtypes(config: dict, name: str):
    """(parameter dtype, autocast dtype or None) of the module path: fp32 parameters with bf16
    autocast where the plan's activations are 16-bit (auto), or one dtype throughout."""
    if name == "auto":
        return torch.float32, torch.bfloat16 if config.get("act_bytes", 2) == 2 else None
    if name not in DTYPES:
        raise OptionError("dtype", f"{name!r} is unknown: use auto, {', '.join(DTYPES)}")
    return (torch.float32, torch.bfloat16) if name == "bfloat16" else (DTYPES[name], None)


def run_module_plan(plan, d: Dist, *, module: str = DEFAULT_MODULE, layers=None, steps=5, warmup=1,
                    profile_steps=2, dtype="auto", seed=0, lr=1e-3, progress=None, apply_path: str = "auto",
                    build=build_module):
    """(the result record, the placed module): ``module``'s model (``package.module:factory``, called
    with the plan's model config; by ``build``, ``build_module`` or a ``BuildOnce``) placed by ``autotune.apply``
    as ``plan`` (a plan of plan.json, or a typed plan) says, trained by ``ModuleTrainer`` (each rank its piece of
    the batch). A module may carry ``plan_mapping``, the mapping of plan layers to its module names that apply
    takes. ``apply_path`` "dtensor": the plan placed by DTensor whatever its path (the host's cost of each path:
    ``autotune.execute.hostfit``)."""
    from autotune.apply.place import apply, one_stage, placement_path

    check_steps(steps, warmup, profile_steps)
    typed = one_stage(plan)
    cluster = plan_cluster(typed, d.launch.world)
    if layers is not None:
        if layers < 1:
            raise OptionError("layers", "must be at least 1")
        typed = replace(typed, model=ModelSpec(typed.model.kind, dict(typed.model.config, layers=layers)))
    config = {"kind": typed.model.kind, **typed.model.config}
    d.check_cpu_room(typed.costs.memory_bytes if typed.costs and layers is None else None)
    d.set_mesh(cluster.axis_sizes)
    param_dtype, autocast = module_dtypes(config, dtype)
    check_apply_path(apply_path)
    # built on the CPU, as the README builds it: apply moves this rank's part to its device
    model = build(module, config, seed, param_dtype, "cpu" if d.launch.world > 1 else d.device)
    mapping = getattr(model, "plan_mapping", None)
    path = placement_path(typed, model, mapping, path=apply_path)
    placed = apply(typed, model, d.mesh, mapping=mapping, path=apply_path)  # the DDP module on the "ddp" path
    trainer = ModuleTrainer(placed, config, typed.micro_batches, d, seed, lr, autocast)
    try:
        measured = trainer.run(steps, warmup, profile_steps, progress)
    finally:
        trainer.close()
    return result_header(typed.strategy, config, cluster, d) | {
        "executor": "apply", "module": module, "apply_path": path,
        "dtype": str(autocast or param_dtype).replace("torch.", ""), "steps": steps, "warmup": warmup, "profile_steps": profile_steps, "micro_batches": typed.micro_batches,
        "measured": measured, "predicted": predicted(typed), "predicted_layers": {},
        "predicted_comparable": layers is None,
    }, model


def result_header(strategy: str, config: dict, cluster: Cluster, d: Dist) -> dict:
    """The fields every execute result starts with: the plan, the launch, the machine."""
    return {"kind": KIND, "version": VERSION, "strategy": strategy, "model": config,
            "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node},
            "world": d.launch.world, "launcher": d.launch.launcher, "backend": "nccl" if d.is_gpu else "gloo",
            "device": torch.cuda.get_device_name(d.device) if d.is_gpu else platform.processor() or "cpu",
            "torch": torch.__version__}


def free_device(d: Dist) -> None:
    """Everything of the previous plan freed and the peak-memory counter reset, so that each
    plan's peak is its own."""
    gc.collect()
    if d.is_gpu:
        torch.cuda.synchronize(d.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d.device)


def predicted(plan: Plan, keys=PREDICTED) -> dict:
    """The plan's predicted figures that a result records beside the measured ones."""
    costs = plan.costs.to_dict() if plan.costs else {}
    return {k: costs[k] for k in keys if k in costs}


def out_of_memory_record(plan: Plan, d: Dist, message: str) -> dict:
    """The record of a plan that ran out of device memory (the summary lists it apart)."""
    return result_header(plan.strategy, {"kind": plan.model.kind, **plan.model.config}, plan.cluster, d) | {
        "error": "out of memory", "detail": message.splitlines()[0][:300], "predicted": predicted(plan)}
