"""Stages of several devices on apply's local path: ``autotune.apply_pipeline`` on 4 processes as 2 stages x 2
devices (gloo, float64) places a stage whose plan is data parallel through DDP and one in FSDP mode through
fully_shard on the stage's submesh (each rank its piece of every micro-batch, the boundary each rank's local
piece), and agrees with one process: the first step's gradients, the loss of every step on every rank (the mean
over the whole batch: the pieces' losses averaged over the stage's data ranks) and every parameter after two Adam
steps, to 1e-9 (relative), for a small GPT (tied embedding and logits, sharded in both the first and the last
stage: their gradients summed between the stages) and a small Hugging Face Llama, with 4 micro-batches (so that
DDP's one all-reduce per step and fully_shard's unsharded gradients both accumulate over micro-batches). Each rank
reports the path its stage took, which must be the one ``stage_paths`` names: a stage falling back to the
DTensor path fails. A stage that replicates everything beside a fully_shard one keeps the DTensor path (the
boundary reshards S0 -> B on its submesh). The search's 2 x 2 plan of a 1.1 B Llama (the first stage's embedding
by columns, the last stage's logits by vocabulary with a vocabulary-parallel loss) runs on DDP and on fully_shard
(and a GPT's untied head by vocabulary; tied, it keeps the DTensor path), with its collectives counted: per
micro-batch the stream's all-gather before the logits, the reduce-scatter back, the loss's two all-reduces.
Planted bugs fail: gradients summed instead of averaged over the stage's data ranks, the first stage's
micro-batches not cut into pieces, the FSDP module not recognised by ``PipelineStage`` (fully_shard gathering and
reduce-scattering every micro-batch: the collective counts), the column embedding's gradient not scaled, the
head's stream gradient cut to the piece instead of reduce-scattered, and not scaled to the pieces' losses."""
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
import torch.distributed.pipelining.stage  # noqa: E402,F401  (the planted bug patches its FSDPModule)
import transformers  # noqa: E402,F401

from pipeline_exec_plans import (GPT, GPT_PLAIN, LLAMA, LR, STEPS, batch, column_embedding,  # noqa: E402
                                 first_gradients, in_micro_batches, make_model, megatron, replicated, restage,
                                 check_ranks, searched, sharded, train_one_process, vocabulary_head,
                                 vocabulary_parallel)
from gloo_runner import run_on_gloo  # noqa: E402

from autotune.apply import pipeline as stages_module  # noqa: E402
from autotune.apply import vocab as vocab_module  # noqa: E402
from autotune.apply.batch import DataSplit  # noqa: E402

RTOL = 1e-9
M = 4  # micro-batches of 8 sequences (batch 32): 4 per device
_FULLY_SHARD = stages_module.fully_shard_model
_VOCAB_LOGITS = stages_module._vocab_logits


def _summed(model, *args):
    """A planted bug: fully_shard's gradients summed over the stage's data ranks instead of averaged."""
    from torch.distributed.fsdp import FSDPModule
    out = _FULLY_SHARD(model, *args)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
    return out


def _chunked(g, group):
    """A planted bug: the gradient of the gathered stream cut to this rank's piece, not reduce-scattered."""
    import torch.distributed as dist
    return g.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def _unscaled_head(x, *, module, group, factor):
    """A planted bug: the stream's gradient from the whole micro-batch's loss not scaled to the pieces' losses."""
    return _VOCAB_LOGITS(x, module=module, group=group, factor=1.0)


# planted bugs: gradients summed over the stage's data ranks; the first stage's micro-batches not cut into
# pieces; the fully_shard module not recognised by PipelineStage (which then gathers and reduce-scatters every
# micro-batch: not torchtitan's step, which the plan prices); the gradient of an embedding by columns (and of a
# boundary beside a DTensor-path stage) not rescaled; the vocabulary-parallel head's stream gradient chunked
# instead of reduce-scattered, or not scaled from the whole micro-batch's loss to the pieces'
BUGS = {"summed": lambda: mock.patch.object(stages_module, "fully_shard_model", _summed),
        "uncut": lambda: mock.patch.object(DataSplit, "cut_calls", lambda self, model: None),
        "unrecognised": lambda: mock.patch.object(torch.distributed.pipelining.stage, "FSDPModule",
                                                  type("Other", (), {})),
        "unscaled": lambda: _both(mock.patch.object(stages_module, "scale_grad", lambda x, factor: x),
                                  mock.patch.object(vocab_module, "scale_grad", lambda x, factor: x)),
        "chunked": lambda: mock.patch.object(vocab_module, "_reduce_scatter", _chunked),
        "unscaled-head": lambda: mock.patch.object(stages_module, "_vocab_logits", _unscaled_head)}


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def _whole(p):
    return (p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p).detach().clone()


@contextlib.contextmanager
def counting(pipe, calls: dict):
    """``calls`` counts the all-gathers and reduce-scatters (fully_shard's, the vocabulary-parallel head's stream),
    every ``all_reduce`` call (a data-parallel stage's bucket, the loss's) meanwhile."""
    import torch.distributed as dist

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call
    # fully_shard's (torch 2.13: the *_single names) and the head's (the names every torch 2.x has); neither
    # calls the other through the module's attribute, so each call is counted once
    with contextlib.ExitStack() as stack:
        for name, kind in (("all_gather_single", "allgather"), ("all_gather_into_tensor", "allgather"),
                           ("reduce_scatter_single", "reducescatter"), ("reduce_scatter_tensor", "reducescatter"),
                           ("all_reduce", "reduce")):
            if hasattr(dist, name):
                stack.enter_context(mock.patch.object(dist, name, counted(kind, getattr(dist, name))))
        yield


def named_parameters(module, names: dict):
    """(the model's name, parameter) of the stage module's parameters; a parametrized one (the DTensor path's
    FSDP gather at use) by the name of the weight it stands for."""
    from torch.nn.utils import parametrize
    for _, m in module.named_modules():
        if id(m) not in names:  # a parametrization's container: its owner reports it
            continue
        own = dict(m.named_parameters(recurse=False))
        if parametrize.is_parametrized(m):
            own.update({pn: m.parametrizations[pn].original for pn in m.parametrizations})
        for pn, p in own.items():
            yield f"{names[id(m)]}.{pn}".lstrip("."), p


def train_pipelined(cfg: dict, plan: dict):
    """STEPS Adam steps of this rank's stage: (losses, parameters, first step's gradients, by the model's names;
    the path its stage took; its collectives in the last step and its fully_shard units)."""
    import autotune
    from torch.distributed.fsdp import FSDPModule
    model = make_model(cfg)
    names = {id(m): n for n, m in model.named_modules()}
    pipe = autotune.apply_pipeline(plan, model)
    opt = torch.optim.Adam(pipe.module.parameters(), lr=LR)
    ids, targets = batch(cfg)
    losses, grads = [], {}
    for step in range(STEPS):
        calls = dict(allgather=0, reducescatter=0, allreduce=0, reduce=0) if step else {}
        with counting(pipe, calls) if step else contextlib.nullcontext():
            losses.append(float(pipe.step(ids, targets)))
        if step == 0:
            grads = {name: _whole(p.grad) for name, p in named_parameters(pipe.module, names)}
        opt.step()
        opt.zero_grad()
    params = {name: _whole(p) for name, p in named_parameters(pipe.module, names)}
    # fully_shard's units that manage parameters (a first stage's root holds none where its embedding is by columns)
    units = [m for m in pipe.module.modules()
             if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None]
    return (losses, params, grads, pipe.path, calls, (len(units), any(m is pipe.module for m in units)),
            (pipe.stage, len(pipe.plan.stages), len(pipe.tied)))


def mismatch(ref, grads_ref, got, path: str, vocabulary: bool = False) -> str | None:
    """Where the pipelined run differs from one process, or from what the step model prices (None: it agrees):
    the path, the gradients, the parameters, the losses; the collectives of the last step: a data-parallel stage
    one all-reduce after the schedule (the tiny model's one bucket), fully_shard each micro-batch's
    torchtitan's PP + FSDP step (``autotune.apply.pipeline``): per unit holding parameters one reduce-scatter, and
    all-gathers m + 1 of a block's unit (the first forward and every pass after a forward), 1 of the root's; a
    last stage whose logits are split by vocabulary (``vocabulary``, on a local path) per micro-batch the
    stream's all-gather before them and reduce-scatter back (the plan's S0 -> B boxing) and its loss's two
    all-reduces (the maxima; the sums of exponentials with the target logits). Every ``all_reduce`` call counted:
    the data-parallel stage's bucket, the loss averaged over a local last stage's data ranks, the tied weights' sum, the loss's."""
    if isinstance(got, str):
        return got
    losses, params, grads, took, calls, units, (stage, stages, tied) = got
    if took != path:
        return f"the stage took the {took} path, not {path}"
    for what, have, want in (("gradient", grads, grads_ref), ("parameter", params, ref[1])):
        for name, x in have.items():
            if name not in want:
                return f"{what} {name} is not the model's"
            if not torch.allclose(x, want[name], rtol=RTOL, atol=RTOL):
                return f"{what} {name} differs by {(x - want[name]).abs().max():.3g}"
    if not np.allclose(losses, ref[0], rtol=RTOL, atol=0):
        return f"losses {losses} != {ref[0]}"
    units, root = units
    gathers = (units - root) * (M + 1) + root
    want = {"fully_shard": (gathers, units, 0)}.get(path, (0, 0, 0))
    head = vocabulary and stage == stages - 1 and path in ("ddp", "fully_shard")
    want = (want[0] + M * head, want[1] + M * head, want[2])
    reduces = (path == "ddp") + (stage == stages - 1 and path in ("ddp", "fully_shard")) + tied + 2 * M * head
    have = (calls["allgather"], calls["reducescatter"], calls["allreduce"])
    if have != want:
        return f"collectives (all-gathers, reduce-scatters, all-reduces) {have}, priced {want} ({units} units)"
    if calls["reduce"] != reduces:
        return f"{calls['reduce']} all_reduce calls, not {reduces}"
    return None


def jobs_for(kind: str) -> tuple[dict, list]:
    """(model config, [(plan, the paths its stages take, planted bug or None[, the paths the plan asks for
    where its modules refuse one])]); the bugs last (a job that fails on some ranks may leave the others' groups
    unusable)."""
    cfg = dict(GPT if kind.startswith("gpt") else LLAMA, batch=32)
    if kind == "gpt-untied":
        cfg["tied"] = False
    ddp = in_micro_batches(searched(cfg, 2), M)
    fsdp = sharded(sharded(ddp, 0), 1)
    both, ddps = ["fully_shard", "fully_shard"], ["ddp", "ddp"]
    if kind == "gpt":  # its embedding by columns asked for, but tied (and with positions): by DTensor; so is its
        # head by vocabulary (tied to an embedding split otherwise)
        return cfg, [(ddp, ddps, None), (fsdp, both, None),
                     (restage(sharded(ddp, 0), 1, replicated), ["fully_shard", "dtensor"], None),
                     (column_embedding(fsdp), ["dtensor", "fully_shard"], None, both),
                     (vocabulary_head(ddp), ["ddp", "dtensor"], None, ddps),
                     (fsdp, both, "unrecognised"), (fsdp, both, "summed")]
    if kind == "gpt-untied":  # the head by vocabulary on DDP and on fully_shard
        return cfg, [(vocabulary_head(ddp), ddps, None), (vocabulary_head(fsdp), both, None),
                     (vocabulary_head(ddp), ddps, "unscaled-head")]
    # the search's 2 x 2 plan of a 1.1 B Llama: the embedding by columns, the head by vocabulary, DDP blocks
    searchs = vocabulary_head(column_embedding(ddp))
    return cfg, [(fsdp, both, None), (ddp, ddps, None), (column_embedding(fsdp), both, None),
                 (column_embedding(ddp), ddps, None), (vocabulary_head(ddp), ddps, None), (searchs, ddps, None), (vocabulary_head(column_embedding(fsdp)), both, None),
                 (column_embedding(fsdp), both, "unscaled"), (searchs, ddps, "chunked"),
                 (searchs, ddps, "unscaled-head"), (ddp, ddps, "uncut")]


@pytest.mark.parametrize("kind", ["gpt", "gpt-untied", "llama"])
def test_local_stages_match_one_process(kind):
    from autotune.apply.pipeplan import load_pipelined, stage_paths
    cfg, jobs = jobs_for(kind)
    for plan, paths, _, *asks in jobs:
        assert stage_paths(load_pipelined(plan)) == (asks[0] if asks else paths)
    results = run_on_gloo(train_pipelined, [(cfg, p, bug) for p, _, bug, *_ in jobs], bugs=BUGS, timeout=180)
    ref, grads = train_one_process(cfg, M), first_gradients(cfg, M)
    assert ref[0][1] != pytest.approx(ref[0][0])  # the loss moved between the steps
    for k, (plan, paths, bug, *_) in enumerate(jobs):
        problems = [mismatch(ref, grads, results[r][k], paths[r // 2], vocabulary_parallel(plan)) for r in range(4)]
        check_ranks(problems, bug, results, k, ref[1], f"{kind} {paths}")


def whole_loss(name: str, key: str, fine: tuple) -> tuple:
    """The loss's input (the logits) whole on the stage's axis: the search's "loss-replicated"."""
    return tuple("B" if p == "S1" else p for p in fine) if name == "loss" else fine


def test_which_stages_take_which_path():
    """A stage takes apply's local path where its plan is data parallel or fully_shard-shaped (or becomes so once
    a first stage's embedding by columns or a last stage's logits by vocabulary with a vocabulary-parallel loss
    are read as data parallel, on DDP or fully_shard) and the stream arrives and leaves as each rank's local
    piece; Megatron's tensor-parallel stages take the tensor path where the residual stream crosses whole (a
    Llama's), DTensor's where a partial sum crosses (AutoDDL's graph); replicated stages, a data-parallel stage
    that receives the stream whole and logits by vocabulary whose loss takes them whole keep DTensor's; a stage
    of one device is placed as it is."""
    from autotune.apply.pipeplan import load_pipelined, stage_paths
    cfg = dict(LLAMA, batch=32)
    ddp = in_micro_batches(searched(cfg, 2), M)
    cases = [(ddp, ["ddp", "ddp"]), (sharded(ddp, 1), ["ddp", "fully_shard"]),
             (restage(ddp, 1, replicated), ["ddp", "dtensor"]),
             (restage(ddp, 0, replicated), ["dtensor", "dtensor"]),  # the stream reaches stage 1 whole
             (column_embedding(ddp), ["ddp", "ddp"]),
             (column_embedding(sharded(ddp, 0)), ["fully_shard", "ddp"]),
             (vocabulary_head(column_embedding(ddp)), ["ddp", "ddp"]),  # the search's 2 x 2 Llama
             (vocabulary_head(sharded(ddp, 1)), ["ddp", "fully_shard"]),
             (restage(vocabulary_head(ddp), 1, whole_loss), ["ddp", "dtensor"]),
             (megatron(dict(GPT_PLAIN, batch=32), 2, 2, 2, 2, 16), ["dtensor", "dtensor"]),  # partial boundary
             (megatron(cfg, 2, 2, 2, 2, M), ["tensor", "tensor"]),  # the residual stream whole: torch's styles
             (searched(dict(GPT, batch=8), 4), ["none"] * 4)]
    assert [stage_paths(load_pipelined(plan)) for plan, _ in cases] == [paths for _, paths in cases]


def _columns_loss():
    """Each rank its columns (``torch.chunk``) of the same logits: ``_vocab_loss`` and its gradient."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    got = []
    for dtype in (torch.float64, torch.bfloat16):
        logits, targets = _loss_case(dtype)
        columns = logits.chunk(world, -1)
        mine = columns[rank].detach().clone().requires_grad_()
        offset = sum(c.shape[-1] for c in columns[:rank])
        loss = stages_module._vocab_loss(mine, targets, group=dist.group.WORLD, offset=offset)
        (3 * loss).backward()
        got.append((loss.detach(), mine.grad))
    return got


def _loss_case(dtype):
    """Logits of 2 x 5 tokens over a vocabulary of 13 (split 7 + 6), large enough to overflow exp unshifted,
    and targets with two left out (-100)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 5, 13, generator=g, dtype=torch.float64) * 4 + 800).to(dtype)
    targets = torch.randint(0, 13, (2, 5), generator=g)
    targets[0, 1] = targets[1, 4] = -100
    return logits, targets


def test_vocabulary_parallel_loss():
    """``_vocab_loss`` on 2 ranks' columns gives torch's cross entropy of the whole logits (the mean over the
    targets that are not -100; half precision in float32, as under autocast) and each rank the gradient of its
    columns."""
    got = [ranks[0] for ranks in run_on_gloo(_columns_loss, [()], 2, timeout=60)]
    for k, (dtype, tol) in enumerate(((torch.float64, 1e-12), (torch.bfloat16, 1e-2))):
        logits, targets = _loss_case(dtype)
        whole = logits.float().requires_grad_() if dtype == torch.bfloat16 else logits.clone().requires_grad_()
        want = torch.nn.functional.cross_entropy(whole.flatten(0, 1), targets.flatten())
        (3 * want).backward()
        grads = whole.grad.to(dtype).chunk(2, -1)
        for r in range(2):
            loss, grad = got[r][k]
            assert loss.dtype == want.dtype and grad.dtype == dtype
            assert torch.allclose(loss.double(), want.double(), rtol=tol, atol=0), (dtype, r, loss, want)
            assert torch.allclose(grad.double(), grads[r].double(), rtol=tol, atol=tol), (dtype, r)
