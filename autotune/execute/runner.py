"""Execute one plan on the launched processes: check it fits them, build the
model, train K steps, and return the measured figures beside the plan's
predictions (a versioned record)."""
from __future__ import annotations

import gc
import platform
from dataclasses import replace

from calibrate.errors import OptionError, UserError

from autotune.execute import ops
from autotune.execute.env import Dist
from autotune.execute.launch import check_steps
from autotune.execute.layout import DTensor, placements, torch
from autotune.execute.model import PlanModel
from autotune.execute.moduletrain import ModuleTrainer, build_module
from autotune.execute.planread import check_apply_path, layer_specs, plan_graph
from autotune.execute.result import KIND, VERSION
from autotune.execute.train import Trainer
from autotune.execute.usermodule import DEFAULT_MODULE
from autotune.sbp.mesh import Cluster

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
PREDICTED = ("step_s", "compute_s", "exposed_comm_s", "total_s", "redistribution_s", "grad_sync_s", "memory_bytes")


def plan_cluster(plan: dict, world: int) -> Cluster:
    try:
        c = plan["cluster"]
        cluster = Cluster(int(c["nodes"]), int(c["gpus_per_node"]))
    except (KeyError, TypeError, ValueError):
        raise UserError("the plan has no cluster section: re-run the search (python -m autotune --out DIR)") from None
    if cluster.devices != world:
        raise UserError(
            f"the plan {plan.get('strategy', '')!r} is for {cluster} = {cluster.devices} devices but {world} processes "
            f"were launched: launch {cluster.devices} (e.g. torchrun --nproc-per-node {cluster.devices}) or search "
            f"a plan with --nodes/--gpus-per-node for {world}")
    return cluster


def prepare(plan: dict, world: int, layers: int | None = None):
    """(graph, cluster, layer specs): everything checked before any work starts."""
    cluster = plan_cluster(plan, world)
    graph = plan_graph(plan, layers)
    return graph, cluster, layer_specs(plan, graph, cluster)


def compute_dtype(graph, name: str):
    if name == "auto":
        return torch.bfloat16 if graph.act_bytes == 2 else torch.float32
    if name not in DTYPES:
        raise OptionError("dtype", f"{name!r} is unknown: use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def build(plan: dict, d: Dist, layers: int | None, dtype_name: str, seed: int):
    graph, cluster, specs = prepare(plan, d.launch.world, layers)
    d.set_mesh(cluster.axis_sizes)
    dtype = compute_dtype(graph, dtype_name)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    ctx = ops.Ctx(d.mesh, d.coords, d.axis_sizes, dtype, stat)
    return graph, cluster, PlanModel(graph, specs, ctx, seed, dtype, d.device)


def run_plan(plan: dict, d: Dist, *, layers=None, steps=5, warmup=1, profile_steps=2, dtype="auto", seed=0,
             lr=1e-3, progress=None) -> tuple[dict, PlanModel]:
    """(the result record, the trained model)."""
    check_steps(steps, warmup, profile_steps)
    graph, cluster, model = build(plan, d, layers, dtype, seed)
    trainer = Trainer(model, graph, d, seed, lr)
    try:
        measured = trainer.run(steps, warmup, profile_steps, progress)
    finally:
        trainer.close()
    plan_layers = (plan.get("model") or {}).get("layers")
    totals = plan.get("totals", {})
    return {
        "kind": KIND, "version": VERSION, "strategy": plan.get("strategy", ""), "executor": "ops",
        "model": dict(plan.get("model") or {}, layers=graph.config.get("layers", plan_layers)),
        "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node},
        "world": d.launch.world, "launcher": d.launch.launcher, "backend": "nccl" if d.is_gpu else "gloo",
        "device": torch.cuda.get_device_name(d.device) if d.is_gpu else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(model.ctx.dtype).replace("torch.", ""),
        "steps": steps, "warmup": warmup, "profile_steps": profile_steps, "micro_batches": graph.micro_batches,
        "measured": measured,
        "predicted": {k: totals[k] for k in PREDICTED if k in totals},
        "predicted_layers": predicted_layers(plan),
        "predicted_comparable": plan_layers is None or graph.config.get("layers", plan_layers) == plan_layers,
    }, model


def module_dtypes(config: dict, name: str):
    """(parameter dtype, autocast dtype or None) of the module path: fp32 parameters with bf16
    autocast where the plan's activations are 16-bit (auto), or one dtype throughout."""
    if name == "auto":
        return torch.float32, torch.bfloat16 if config.get("act_bytes", 2) == 2 else None
    if name not in DTYPES:
        raise OptionError("dtype", f"{name!r} is unknown: use auto, {', '.join(DTYPES)}")
    return (torch.float32, torch.bfloat16) if name == "bfloat16" else (DTYPES[name], None)


def run_module_plan(plan, d: Dist, *, module: str = DEFAULT_MODULE, layers=None, steps=5, warmup=1,
                    profile_steps=2, dtype="auto", seed=0, lr=1e-3, progress=None, apply_path: str = "auto"):
    """(the result record, the placed module): ``module``'s model (``package.module:factory``, called
    with the plan's model config) placed by ``autotune.apply`` as ``plan`` (a plan of plan.json, or a typed
    plan) says, trained by ``ModuleTrainer`` (each rank its piece of the batch). A module may carry
    ``plan_mapping``, the mapping of plan layers to its module names that apply takes. ``apply_path``
    "dtensor": the plan placed by DTensor whatever its path (the host's cost of each path:
    ``autotune.execute.hostfit``)."""
    from autotune.apply.place import apply, placement_path
    from autotune.plan import ModelSpec, load_plan

    check_steps(steps, warmup, profile_steps)
    typed = load_plan(plan)
    cluster = plan_cluster({"cluster": {"nodes": typed.cluster.nodes, "gpus_per_node": typed.cluster.gpus_per_node},
                            "strategy": typed.strategy}, d.launch.world)
    if layers is not None:
        if layers < 1:
            raise OptionError("layers", "must be at least 1")
        typed = replace(typed, model=ModelSpec(typed.model.kind, dict(typed.model.config, layers=layers)))
    config = {"kind": typed.model.kind, **typed.model.config}
    d.set_mesh(cluster.axis_sizes)
    param_dtype, autocast = module_dtypes(config, dtype)
    check_apply_path(apply_path)
    # built on the CPU, as the README builds it: apply moves this rank's part to its device
    model = build_module(module, config, seed, param_dtype, "cpu" if d.launch.world > 1 else d.device)
    mapping = getattr(model, "plan_mapping", None)
    path = placement_path(typed, model, mapping, path=apply_path)
    placed = apply(typed, model, d.mesh, mapping=mapping, path=apply_path)  # the DDP module on the "ddp" path
    trainer = ModuleTrainer(placed, config, typed.micro_batches, d, seed, lr, autocast)
    try:
        measured = trainer.run(steps, warmup, profile_steps, progress)
    finally:
        trainer.close()
    totals = typed.costs.to_dict() if typed.costs else {}
    return {
        "kind": KIND, "version": VERSION, "strategy": typed.strategy, "executor": "apply", "module": module,
        "apply_path": path,
        "model": config, "cluster": {"nodes": cluster.nodes, "gpus_per_node": cluster.gpus_per_node},
        "world": d.launch.world, "launcher": d.launch.launcher, "backend": "nccl" if d.is_gpu else "gloo",
        "device": torch.cuda.get_device_name(d.device) if d.is_gpu else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(autocast or param_dtype).replace("torch.", ""),
        "steps": steps, "warmup": warmup, "profile_steps": profile_steps, "micro_batches": typed.micro_batches,
        "measured": measured, "predicted": {k: totals[k] for k in PREDICTED if k in totals},
        "predicted_layers": {}, "predicted_comparable": layers is None,
    }, model


def predicted_layers(plan: dict) -> dict:
    """The plan's per-occurrence predictions that the layer clock measures (``plan.build_plan``):
    layer name -> forward, backward (one micro-batch) and optimizer seconds; "FROM->TO" -> the
    boxing between two layers, forward and backward. Empty for plans made without compute figures."""
    out = {lay["name"]: {k: lay[k] for k in ("forward_s", "backward_s", "optimizer_s")}
           for lay in plan.get("layers", []) if "forward_s" in lay}
    if out:
        out.update({f"{e['from']}->{e['to']}": {k: e[k] for k in ("forward_s", "backward_s")}
                    for e in plan.get("edges", []) if "forward_s" in e})
    return out


def free_device(d: Dist) -> None:
    """Everything of the previous plan freed and the peak-memory counter reset, so that each
    plan's peak is its own."""
    gc.collect()
    if d.is_gpu:
        torch.cuda.synchronize(d.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d.device)


def out_of_memory_record(plan: dict, d: Dist, message: str) -> dict:
    """The record of a plan that ran out of device memory (the summary lists it apart)."""
    return {"kind": KIND, "version": VERSION, "strategy": plan.get("strategy", ""), "model": dict(plan.get("model") or {}),
            "cluster": dict(plan.get("cluster") or {}), "world": d.launch.world, "launcher": d.launch.launcher,
            "backend": "nccl" if d.is_gpu else "gloo",
            "device": torch.cuda.get_device_name(d.device) if d.is_gpu else platform.processor() or "cpu",
            "torch": torch.__version__, "error": "out of memory", "detail": message.splitlines()[0][:300],
            "predicted": {k: plan.get("totals", {})[k] for k in PREDICTED if k in plan.get("totals", {})}}


def gather_weights(model: PlanModel, grads: bool = False) -> list[dict]:
    """Whole weights (or, with ``grads``, their last synchronised gradients) per chain position
    (a collective: every rank calls it)."""
    ctx = model.ctx
    out = []
    for pos, v in enumerate(model.graph.chain):
        shapes = {n: (s, f) for n, s, f in model.specs[v].weights}
        whole = {}
        for name, p in model.params[pos].items():
            shape, fine = shapes[name]
            x = DTensor.from_local(p.grad if grads else p.detach(), ctx.mesh, placements(fine), run_check=False, shape=shape,
                                   stride=tuple(torch.empty(shape, device="meta").stride()))
            whole[name] = x.full_tensor()
        out.append(whole)
    return out
