"""Stages of several devices on apply's local path: ``autotune.apply_pipeline`` on 4 processes as 2 stages x 2
devices (gloo, float64) places a stage whose plan is data parallel through DDP and one in FSDP mode through
fully_shard on the stage's submesh (each rank its piece of every micro-batch, the boundary each rank's local
piece), and agrees with one process: the first step's gradients, the loss of every step on every rank (the mean
over the whole batch: the pieces' losses averaged over the stage's data ranks) and every parameter after two Adam
steps, to 1e-9 (relative), for a small GPT (tied embedding and logits, sharded in both the first and the last
stage: their gradients summed between the stages) and a small Hugging Face Llama, with 4 micro-batches (so that
DDP's one all-reduce per step and fully_shard's reduce-scatter per micro-batch both accumulate). Each rank
reports the path its stage took, which must be the one ``stage_paths`` names: a stage falling back to the
DTensor path fails. A stage that replicates everything beside a fully_shard one keeps the DTensor path (the
boundary reshards S0 -> B on its submesh). Planted bugs fail: gradients summed instead of averaged over the
stage's data ranks, and the first stage's micro-batches not cut into pieces."""
import contextlib
import os
from unittest import mock

import numpy as np
import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)
import torch.multiprocessing as mp  # noqa: E402
import transformers  # noqa: E402,F401

from pipeline_exec_plans import (GPT, LLAMA, LR, STEPS, batch, first_gradients, in_micro_batches,  # noqa: E402
                                 make_model, replicated, restage, searched, sharded, train_one_process)
from tiny_models import free_port  # noqa: E402

from autotune.plan import stages as stages_module  # noqa: E402
from autotune.plan.place import DataSplit  # noqa: E402

RTOL = 1e-9
M = 4  # micro-batches of 8 sequences (batch 32): 4 per device
_FULLY_SHARD = stages_module._fully_shard


def _summed(*args):
    """A planted bug: fully_shard's gradients summed over the stage's data ranks instead of averaged."""
    return _FULLY_SHARD(*args[:-1], "whole")


BUGS = {"summed": lambda: mock.patch.object(stages_module, "_fully_shard", _summed),
        "uncut": lambda: mock.patch.object(DataSplit, "cut_calls", lambda self, model: None)}


def _whole(p):
    return (p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p).detach().clone()


def train_pipelined(cfg: dict, plan: dict):
    """STEPS Adam steps of this rank's stage: (losses, parameters, first step's gradients, by the model's names;
    the path its stage took)."""
    import autotune
    model = make_model(cfg)
    names = {id(m): n for n, m in model.named_modules()}
    pipe = autotune.apply_pipeline(plan, model)
    opt = torch.optim.Adam(pipe.module.parameters(), lr=LR)
    ids, targets = batch(cfg)
    losses, grads = [], {}
    for step in range(STEPS):
        losses.append(float(pipe.step(ids, targets)))
        if step == 0:
            grads = {f"{names[id(m)]}.{pn}".lstrip("."): _whole(p.grad) for _, m in pipe.module.named_modules()
                     for pn, p in m.named_parameters(recurse=False)}
        opt.step()
        opt.zero_grad()
    params = {f"{names[id(m)]}.{pn}".lstrip("."): _whole(p) for _, m in pipe.module.named_modules()
              for pn, p in m.named_parameters(recurse=False)}
    return losses, params, grads, pipe.path


def _worker(rank, world, port, jobs, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for cfg, plan, bug in jobs:
        try:
            with BUGS[bug]() if bug else contextlib.nullcontext():
                results.append(train_pipelined(cfg, plan))
        except Exception as e:  # a planted bug may fail outright instead of giving other numbers
            results.append(f"{type(e).__name__}: {e}")
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def mismatch(ref, grads_ref, got) -> str | None:
    """Where the pipelined run differs from one process (None: it agrees)."""
    if isinstance(got, str):
        return got
    losses, params, grads, _ = got
    for what, have, want in (("gradient", grads, grads_ref), ("parameter", params, ref[1])):
        for name, x in have.items():
            if name not in want:
                return f"{what} {name} is not the model's"
            if not torch.allclose(x, want[name], rtol=RTOL, atol=RTOL):
                return f"{what} {name} differs by {(x - want[name]).abs().max():.3g}"
    if not np.allclose(losses, ref[0], rtol=RTOL, atol=0):
        return f"losses {losses} != {ref[0]}"
    return None


def jobs_for(kind: str) -> tuple[dict, list]:
    """(model config, [(plan, the paths its stages must take, planted bug or None)])."""
    cfg = dict(GPT if kind == "gpt" else LLAMA, batch=32)
    ddp = in_micro_batches(searched(cfg, 2), M)
    fsdp = sharded(sharded(ddp, 0), 1)
    if kind == "gpt":
        return cfg, [(ddp, ["ddp", "ddp"], None), (fsdp, ["fully_shard", "fully_shard"], None),
                     (restage(sharded(ddp, 0), 1, replicated), ["fully_shard", "dtensor"], None),
                     (fsdp, None, "summed")]
    return cfg, [(fsdp, ["fully_shard", "fully_shard"], None), (ddp, ["ddp", "ddp"], None),
                 (ddp, None, "uncut")]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_local_stages_match_one_process(kind, tmp_path):
    from autotune.plan.stages import load_pipelined, stage_paths
    cfg, jobs = jobs_for(kind)
    for plan, paths, _ in jobs:
        assert paths is None or stage_paths(load_pipelined(plan)) == paths
    out = tmp_path / "results.pt"
    mp.start_processes(_worker, args=(4, free_port(), [(cfg, p, bug) for p, _, bug in jobs], str(out)), nprocs=4,
                       start_method="fork")
    results = [torch.load(f"{out}.{r}") for r in range(4)]
    ref, grads = train_one_process(cfg, M), first_gradients(cfg, M)
    assert ref[0][1] != pytest.approx(ref[0][0])  # the loss moved between the steps
    for k, (plan, paths, bug) in enumerate(jobs):
        problems = [mismatch(ref, grads, results[r][k]) for r in range(4)]
        if bug:
            assert any(problems), f"{kind}: the planted bug {bug!r} went unnoticed"
            continue
        assert not any(problems), f"{kind} {paths}: {[p for p in problems if p]}"
        assert [results[r][k][3] for r in range(4)] == [paths[r // 2] for r in range(4)]  # no DTensor fallback
        seen = {name for r in range(4) for name in results[r][k][1]}
        assert seen == set(ref[1]), f"parameters no stage trained: {sorted(set(ref[1]) - seen)}"
