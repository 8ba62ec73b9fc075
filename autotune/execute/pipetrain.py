"""A pipelined plan's training steps (``python -m autotune execute`` on a plan with ``stages``): the module
of the plan's model (``--module``, the reference modules by default) cut into the plan's stages and placed
by ``autotune.apply_pipeline``, each rank training its stage: the step's micro-batches (the same token ids
and targets as ``autotune.execute.moduletrain`` draws for a single-stage plan) run by the plan's schedule,
then AdamW on the stage's parameters. Measured as the module path measures (step times, host issue time,
peak memory by phase, the loss, which every rank gets from the last stage), beside the pipelined plan's
predictions (its costs and, per stage, the simulated end of its last backward)."""
from __future__ import annotations

from calibrate.errors import OptionError
from models.hf import DEFAULT_MODULE

from autotune.execute.launch import check_steps
from autotune.execute.moduletrain import ModuleTrainer, build_module, token_batch, torch
from autotune.execute.planread import check_apply_path
from autotune.plan.typed import ApplyPath

PREDICTED = ("step_s", "compute_s", "exposed_comm_s", "total_s", "redistribution_s", "grad_sync_s", "memory_bytes",
             "boundary_s", "bubble_s")


def check_pipelined(plan, world: int, layers: int | None):
    """The pipelined plan read and checked against the launch before any work starts."""
    from autotune.execute.runner import plan_cluster
    from autotune.apply.pipeplan import load_pipelined
    from autotune.plan.file import load_plan
    if layers is not None:
        raise OptionError("layers", "a pipelined plan splits its model's blocks among its stages: drop --layers, or "
                                    "search a plan for that many layers")
    plan = load_plan(plan)
    plan_cluster(plan, world)
    return load_pipelined(plan)


class PipelineTrainer(ModuleTrainer):
    """``ModuleTrainer`` whose step is the pipeline schedule's over the whole batch."""

    def __init__(self, pipe, config: dict, d, seed: int, lr: float, autocast=None):
        super().__init__(pipe.module, config, pipe.plan.micro_batches, d, seed, lr, autocast)
        self.pipe = pipe

    def forward_backward(self, step: int):
        """The schedule over the step's micro-batches (drawn as the single-stage path draws them); the loss."""
        pairs = [token_batch(self.config, self.seed, step, j, self.d.device) for j in range(self.micro_batches)]
        ids, targets = torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
        with self.autocast():
            return self.pipe.step(ids, targets)


def run_pipeline_plan(plan, d, *, module: str = DEFAULT_MODULE, layers=None, steps=5, warmup=1,
                      profile_steps=2, dtype="auto", seed=0, lr=1e-3, progress=None, apply_path: str = "auto",
                      build=build_module):
    """(the result record, this rank's pipeline): ``module``'s model (by ``build``, as ``run_module_plan``) cut and
    placed by ``apply_pipeline`` (``apply_path`` "dtensor": every stage of several devices on the DTensor path)."""
    import autotune
    from autotune.execute.runner import module_dtypes, predicted, result_header

    check_steps(steps, warmup, profile_steps)
    check_apply_path(apply_path)
    pp = check_pipelined(plan, d.launch.world, layers)
    config = {"kind": pp.model.kind, **pp.model.config}
    d.check_cpu_room(pp.costs.memory_bytes if pp.costs and layers is None else None)
    param_dtype, autocast = module_dtypes(config, dtype)
    # built on the CPU: apply_pipeline moves this rank's stage to its device, and the rest stays off the GPU
    pipe = autotune.apply_pipeline(pp, build(module, config, seed, param_dtype, "cpu"),
                                   local=apply_path != ApplyPath.DTENSOR)
    trainer = PipelineTrainer(pipe, config, d, seed, lr, autocast)
    try:
        measured = trainer.run(steps, warmup, profile_steps, progress)
    finally:
        trainer.close()
    return result_header(pp.strategy, config, pp.cluster, d) | {
        "executor": "pipeline", "module": module, "dtype": str(autocast or param_dtype).replace("torch.", ""),
        "steps": steps, "warmup": warmup, "profile_steps": profile_steps, "micro_batches": pp.micro_batches,
        "pipeline": {"stages": len(pp.stages), "split": list(pp.pipeline.split), "schedule": pp.pipeline.schedule,
                     "library_schedule": type(pipe.schedule).__name__, "paths": list(pipe.paths),
                     "submesh": {"nodes": pp.submesh.nodes, "gpus_per_node": pp.submesh.gpus_per_node}},
        "measured": measured,  # each stage's predicted peak too: the summary compares them stage by stage
        "predicted": predicted(pp, PREDICTED) | {"stage_memory_bytes": [st.memory_bytes for st in pp.stages]},
        "predicted_layers": {}, "predicted_comparable": True,
    }, pipe
