"""Context parallelism inside a pipeline's stages as ``autotune.apply_pipeline`` runs it (``autotune.apply.context``'s
one-stage code shared: its groups, its attention): the Megatron 3-D plan of a context-parallel graph
(``autotune.pipeline.threed``: 2 stages, each a context group of 2 on the DDP path), the first stage cutting each
micro-batch's sequences into the rank's two chunks, every stage's rotary embeddings given the chunks' global
positions, the stream crossing the boundary as each rank's chunks and the last stage's loss of the targets cut
alike. On 4 gloo processes in float64 a small Hugging Face Llama agrees with one process to 1e-9 (relative): the
loss of every step and every parameter after two Adam steps; fully_shard's stage (the plan's stages sharded) alike.
Planted bugs fail it: the chunks in order (rank i the i-th half), K and V in rank order, and a later stage's
positions its local ones (0, 1, ...: the rotary embeddings of the chunks wrong)."""
import os
from unittest import mock

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)

from gloo_runner import run_on_gloo  # noqa: E402
from pipeline_exec_plans import LLAMA, adam_steps, make_model, sharded, stage_parameters, train_one_process  # noqa
from test_apply_context_parallel import BUGS  # noqa: E402
from test_pipeline_exec import mismatch  # noqa: E402

from autotune.apply import context  # noqa: E402

CFG = dict(LLAMA, batch=8)
M = 2


def context_pipeline(cfg: dict, c: int, micro_batches: int):
    """The Megatron 3-D plan (t = 1, 2 stages of 2 x 1 H200) of ``cfg``'s graph made context parallel over ``c``,
    as the plan record writes it."""
    from autotune.pipeline import threed
    from autotune.pipeline.record import pipeline_plan
    from autotune.pipeline.search import PipelineConfig, PipelineSearch
    from autotune.sbp.mesh import Cluster
    from autotune.sbp.techniques import context_parallel
    from calibrate.profile import Profile
    from models import load_model
    graph = context_parallel(load_model(cfg["kind"], None, dict({k: v for k, v in cfg.items() if k != "kind"},
                                                                 attention="flash")), c)
    search = PipelineSearch(graph, Cluster(2, 2), Profile.load("h200-nvlink+ib400"), 80 * 2**30,
                            PipelineConfig(2, "1f1b"))
    found = next(x for x in threed.candidates(search) if x.tensor == 1 and x.micro_batches == micro_batches)
    assert threed.applies(found)
    found = search.finish(found)
    return pipeline_plan(search, found, found.name)


def _local_positions(self, x):
    """Planted: a stage's positions its local ones, 0, 1, ... (the chunks' rotary embeddings wrong)."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand(x.shape[0], -1)


PIPELINE_BUGS = dict(BUGS, local=lambda: mock.patch.object(context.ContextGroup, "stream_positions",
                                                            _local_positions))


def train_stage(cfg: dict, plan) -> tuple:
    """Two Adam steps of this rank's stage: (losses, its parameters whole by the model's names, its path, the shape
    of the stream arriving at it)."""
    import autotune
    model = make_model(cfg)
    names = {id(m): n for n, m in model.named_modules()}
    pipe = autotune.apply_pipeline(plan, model)
    seen = []
    pipe.module.register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[0].shape)))
    losses = adam_steps(pipe, cfg)
    return losses, stage_parameters(pipe.module, names), pipe.path, seen[-1]


def test_context_parallel_stages_match_one_process():
    from autotune.apply.pipeplan import stage_paths
    from autotune.plan.layouts import context_size
    plan = context_pipeline(CFG, 2, M)
    fsdp = sharded(sharded(plan, 0), 1)
    assert [context_size(s.plan) for s in plan.stages] == [2, 2] and stage_paths(plan) == ["ddp", "ddp"]
    assert stage_paths(fsdp) == ["fully_shard", "fully_shard"]
    bugs = ("in order", "unordered", "local")
    results = run_on_gloo(train_stage, [(CFG, plan, None), (CFG, fsdp, None)] + [(CFG, plan, b) for b in bugs],
                          world=4, bugs=PIPELINE_BUGS, timeout=60)
    ref = train_one_process(CFG, M)
    for k, path in enumerate(("ddp", "fully_shard")):
        problems = [mismatch(ref, results[r][k]) for r in range(4)]
        assert not any(problems), (path, [x for x in problems if x])
        assert {results[r][k][2] for r in range(4)} == {path}
        # micro-batches of 4 sequences, one context group: each rank the 4 sequences' two chunks of 2 of 8 positions,
        # its ids in the first stage, the stream arriving at the second
        assert [results[r][k][3] for r in range(4)] == [(4, CFG["sequence"] // 2)] * 2 + \
            [(4, CFG["sequence"] // 2, CFG["hidden"])] * 2
    for k, bug in enumerate(bugs, 2):
        assert any(mismatch(ref, results[r][k]) for r in range(4)), f"the planted bug {bug!r} went unnoticed"
