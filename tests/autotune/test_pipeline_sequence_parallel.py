"""Megatron's sequence parallelism in a pipeline's stages as apply runs it (issue 43): a 3-D plan with
``--sequence-parallel`` (norms and the residual stream split by the sequence on the tensor axis) places each stage
on the tensor path with torch's ``SequenceParallel`` norms (``autotune.apply.tensor``), the stream a DTensor of
sequence shards inside a stage and each rank's shard crossing the boundary (1 / t of the activation, as the step
model prices it); TP + FSDP with it on fully_shard's path alike. On 8 gloo processes (2 stages x 2 data x 2
tensor ranks, float64, 8 micro-batches) a small Hugging Face Llama agrees, on each path, with one process to 1e-9 (relative): the loss of every step and every parameter after
two Adam steps; the second stage receives (2 sequences, 4 of 8 positions, hidden). Planted bug (shown once): the
arriving shard read as the whole sequence (``Replicate``) fails."""
import os
from unittest import mock

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)
import transformers  # noqa: E402,F401

from pipeline_exec_plans import (LLAMA, adam_steps, make_model, megatron, sharded, stage_parameters,  # noqa: E402
                                 train_one_process)
from gloo_runner import run_on_gloo  # noqa: E402
from test_pipeline_exec import mismatch  # noqa: E402

from autotune.apply import pipeline as stages_module  # noqa: E402

CFG = dict(LLAMA, batch=32)
M = 8


def _whole_sequence(x, *, mesh, then=None):
    """A planted bug: the arriving sequence shard read as the whole sequence."""
    from torch.distributed.tensor import DTensor, Replicate
    return DTensor.from_local(then(x) if then else x, mesh, [Replicate()], run_check=False)


def train_stage(cfg: dict, plan) -> tuple:
    """STEPS Adam steps of this rank's stage: (losses, its parameters whole by the model's names, its path, the
    shape of the stream arriving at it)."""
    import autotune
    model = make_model(cfg)
    names = {id(m): n for n, m in model.named_modules()}
    pipe = autotune.apply_pipeline(plan, model)
    seen = []
    pipe.module.register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[0].shape)))
    losses = adam_steps(pipe, cfg)
    return losses, stage_parameters(pipe.module, names), pipe.path, seen[-1]


def test_sequence_parallel_stages_match_one_process():
    from autotune.apply.pipeplan import stage_paths
    plan = megatron(CFG, 2, 4, 2, 2, M, sequence_parallel=True)
    fsdp = sharded(sharded(plan, 0), 1)  # TP + FSDP with sequence parallelism: fully_shard's path
    assert all(s.techniques["sequence_parallel"] for s in plan.stages) and stage_paths(plan) == ["tensor", "tensor"]
    assert stage_paths(fsdp) == ["fully_shard", "fully_shard"]
    bugs = {"whole": lambda: mock.patch.object(stages_module, "_sequence_shards", _whole_sequence)}
    results = run_on_gloo(train_stage, [(CFG, plan, None), (CFG, fsdp, None), (CFG, plan, "whole")], world=8,
                          bugs=bugs)
    ref = train_one_process(CFG, M)
    assert ref[0][1] != pytest.approx(ref[0][0])
    for k, path in enumerate(("tensor", "fully_shard")):
        problems = [mismatch(ref, results[r][k]) for r in range(8)]
        assert not any(problems), (path, [x for x in problems if x])
        assert {results[r][k][2] for r in range(8)} == {path}
        # micro-batches of 4 sequences, 2 a data rank; 8 positions, 4 a tensor rank
        assert [results[r][k][3] for r in range(4, 8)] == [(2, 4, CFG["hidden"])] * 4
    assert any(mismatch(ref, results[r][2]) for r in range(8)), "the planted bug went unnoticed"
