"""The path ``autotune.apply_pipeline`` places a stage plan by, and the host's floor under the stage's time on
that path.

apply runs a stage of several devices on a local path where its plan is one users run: data parallel ("ddp",
through DDP), FSDP / TP + FSDP-shaped ("fully_shard") or data x tensor parallel ("tensor": Megatron's 3-D stages
on torch's ParallelStyles), also with a first stage's embedding split by features or a last stage's logits split
by vocabulary (``autotune.plan.layouts.local_twin``); every other plan takes the
DTensor path ("dtensor": every layer's activations and weights DTensors, each op dispatched through DTensor); a
stage of one device runs as it is ("none"). ``stage_path`` reads it from the stage plan's typed plan as
``autotune.apply.pipeplan.stage_paths`` does (the boundaries aside: tested to agree on searched plans).

The host's floor (``host_floor``): where the profile has host figures for the path (``compute.host_s``,
fitted by ``autotune.execute.hostfit`` from executed steps), the host issues a micro-batch's forward and
backward of the stage's n layer occurrences in n h_pass seconds and its optimizer step in n h_step; a stage
whose kernels take less than that runs at the host's pace, so

    forward + backward = max(device forward + backward, n h_pass)   (both scaled alike)
    optimizer          = max(device optimizer, n h_step)

(full recomputation's re-run forward is not added to the host's share).
"""
from __future__ import annotations

from dataclasses import replace

from autotune.plan.layouts import local_twin, twin_path
from autotune.plan.build import placed
from autotune.plan.typed import ApplyPath
from autotune.sbp.baselines import data_parallel


def dp_assignment(problem) -> list[int] | None:
    """The stage's data-parallel plan (made once per problem and shared with its modes and in-flight copies)."""
    return problem.shared(("data-parallel plan",), lambda: data_parallel(problem))


def stage_path(problem, assign) -> str:
    """The path apply places the stage plan ``assign`` of ``problem`` by (module doc; made once per plan)."""
    if problem.cluster.devices == 1:
        return ApplyPath.NONE.value
    return problem.shared(("apply path", problem.mode, tuple(assign)), lambda: _typed_path(problem, assign))


def _typed_path(problem, assign) -> str:
    return twin_path(local_twin(placed(problem, assign, "stage")))


def host_floor(fig, problem, assign):
    """``fig`` (a ``StageFigures``) with the host's floor of its path (module doc), its ``path`` and ``host``
    (the host's seconds per micro-batch) set; ``fig`` itself where the profile has no host figures."""
    cm = problem.compute
    if cm is None or not cm.host_s:
        return fig
    path = stage_path(problem, assign)
    host = cm.host_seconds(path, len(problem.graph.chain))
    if host is None:
        return replace(fig, path=path)
    per_pass, per_step = host
    device = fig.forward + fig.backward
    scale = per_pass / device if device > 0 and per_pass > device else 1.0
    optimizer = max(fig.optimizer, per_step)
    extra = problem.mb * (scale - 1.0) * device + (optimizer - fig.optimizer)
    return replace(fig, forward=fig.forward * scale, backward=fig.backward * scale, compute=fig.compute + extra,
                   optimizer=optimizer, path=path, host=per_pass)
