"""ZeRO-1/2 as apply runs it (a stage's ``techniques["zero_stage"]``, Megatron-LM's distributed optimizer, as the
3-D plans price it): a data-parallel stage runs on fully_shard over its data ranks (a data x tensor one on its
fully_shard mesh sharded over them instead of replicated) with the weights kept whole
from a step's first forward to its last backward (``reshard_after_forward=False``, torchtitan's ZeRO-2 setting):
per step each fully_shard unit all-gathers once and reduce-scatters once (an all-reduce's traffic, as priced),
and each rank holds half the Adam states on 2 data ranks. On 4 gloo processes (2 stages x 2 devices, 4
micro-batches, float64) the search's plans of a small GPT (tied embedding and logits) and a small Hugging Face
Llama under ZeRO-1 and ZeRO-2, and on 8 a Megatron 3-D plan (t = 2, d = 2) under ZeRO-1, agree with one process
to 1e-9 (relative): the loss of every step and every
parameter after two Adam steps. A ZeRO stage whose placements take the DTensor path, or a ZeRO stage on an FSDP
plan, is one line before any weight moves. Planted bugs (shown once): the weights resharded after each forward
(every micro-batch gathers again: the count fails) and ZeRO ignored (DDP: whole optimizer states, the share
fails)."""
import dataclasses
import os
from unittest import mock

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)
import transformers  # noqa: E402,F401

from pipeline_exec_plans import (GPT, LLAMA, LR, STEPS, batch, in_micro_batches, make_model, replicated,  # noqa: E402
                                 restage, searched, sharded, train_one_process)
from gloo_runner import run_on_gloo  # noqa: E402
from test_pipeline_exec import mismatch  # noqa: E402
from test_pipeline_exec_local import _whole, counting, named_parameters  # noqa: E402

from autotune.apply import pipeline as stages_module  # noqa: E402

M = 4


def zero(plan, stage: int):
    """``plan`` with every stage's optimizer states (and, ZeRO-2, gradients) sharded over its data ranks."""
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, techniques=dict(s.techniques, zero_stage=stage))
                                                  for s in plan.stages))


def train_zero(cfg: dict, plan) -> tuple:
    """STEPS Adam steps of this rank's stage: (losses, its parameters whole by the model's names, its path, the
    all-gathers and reduce-scatters of the last step, its fully_shard units holding weights, the share of the
    Adam states this rank holds)."""
    import autotune
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    model = make_model(cfg)
    names = {id(m): n for n, m in model.named_modules()}
    pipe = autotune.apply_pipeline(plan, model)
    opt = torch.optim.Adam(pipe.module.parameters(), lr=LR)
    ids, targets = batch(cfg)
    losses = []
    for _ in range(STEPS):
        calls = dict(allgather=0, reducescatter=0, reduce=0)
        with counting(pipe, calls):
            losses.append(float(pipe.step(ids, targets)))
        opt.step()
        opt.zero_grad()
    held = [(x.to_local().numel() if isinstance(x, DTensor) else x.numel(), x.numel())
            for state in opt.state.values() for k, x in state.items() if k in ("exp_avg", "exp_avg_sq")]
    units = [m for m in pipe.module.modules()
             if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None]
    params = {name: _whole(p) for name, p in named_parameters(pipe.module, names)}
    return (losses, params, pipe.path, (calls["allgather"], calls["reducescatter"]), len(units),
            sum(a for a, _ in held) / sum(b for _, b in held))


def _eager(*args, **kwargs):
    """A planted bug: ZeRO's weights resharded after each forward (gathered again every micro-batch)."""
    return _FULLY_SHARD(*args, **dict(kwargs, reshard_after_forward=True))


_FULLY_SHARD = stages_module.fully_shard_model
BUGS = {"resharded": lambda: mock.patch.object(stages_module, "fully_shard_model", _eager),
        "ignored": lambda: mock.patch.object(stages_module, "zero_path", lambda path, zero: path)}


def problem(ref, got, want: str = "fully_shard", whole: float = 1.0) -> str | None:
    """Where a ZeRO run differs from one process or from ZeRO's traffic and sharding (None: it agrees): the path
    ``want``, half the share of the Adam states the rank holds without ZeRO (``whole``)."""
    if isinstance(got, str):
        return got
    _, _, path, (gathers, scatters), units, share = got
    if path != want:
        return f"the stage took the {path} path, not {want}"
    differs = mismatch(ref, got)  # the losses and every parameter, to 1e-9
    if differs:
        return differs
    if (gathers, scatters) != (units, units):
        return f"{gathers} all-gathers and {scatters} reduce-scatters a step for {units} units: ZeRO's are one each"
    if share > whole / 2 + 1e-9:
        return f"the rank holds {share:.3f} of the Adam states, not half of {whole:.3f}"
    return None


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_zero_matches_one_process_with_zeros_traffic(kind):
    cfg = dict(GPT if kind == "gpt" else LLAMA, batch=32)
    plan = in_micro_batches(searched(cfg, 2), M)
    jobs = [(cfg, zero(plan, 1), None), (cfg, zero(plan, 2), None)]
    if kind == "gpt":
        jobs += [(cfg, zero(plan, 2), "resharded"), (cfg, zero(plan, 1), "ignored")]
    results = run_on_gloo(train_zero, jobs, bugs=BUGS)
    ref = train_one_process(cfg, M)
    for k, (_, _, bug) in enumerate(jobs):
        problems = [problem(ref, results[r][k]) for r in range(4)]
        if bug:
            assert any(problems), f"the planted bug {bug} went unnoticed"
        else:
            assert not any(problems), f"{kind} ZeRO-{k + 1}: {[x for x in problems if x]}"


def test_zero_on_the_tensor_path():
    # a 3-D plan of 2 stages of 4 devices, t = 2 and d = 2 (8 processes): fully_shard's shard dimension over the
    # data ranks where its replicate one was; each rank holds half the Adam states it holds without ZeRO
    from pipeline_exec_plans import megatron
    cfg = dict(GPT, batch=32)
    plan = megatron(cfg, 2, 4, 2, 2, 8)
    assert [s.plan.mesh.sizes for s in plan.stages] == [(2, 2), (2, 2)]
    results = run_on_gloo(train_zero, [(cfg, plan, None), (cfg, zero(plan, 1), None)], world=8, bugs=BUGS)
    ref = train_one_process(cfg, 8)
    for r in range(8):
        plain, got = results[r]
        assert not isinstance(plain, str) and plain[2] == "tensor", plain
        assert problem(ref, got, "tensor", plain[5]) is None, (r, problem(ref, got, "tensor", plain[5]))


def test_zero_it_cannot_run_is_one_line():
    from autotune.apply.pipeplan import load_pipelined
    from calibrate.errors import UserError
    cfg = dict(GPT, batch=32)
    plan = in_micro_batches(searched(cfg, 2), M)
    with pytest.raises(UserError, match="ZeRO is 0, 1 or 2 on a plan without FSDP"):
        load_pipelined(zero(sharded(plan, 0), 1))
    with pytest.raises(UserError, match="ZeRO is 0, 1 or 2"):
        load_pipelined(zero(plan, 3))
    # a stage replicating everything takes the DTensor path, which does not shard optimizer states
    results = run_on_gloo(train_zero, [(cfg, zero(restage(plan, 1, replicated), 1))])
    assert all("ZeRO-1" in results[r][0] and "DTensor path" in results[r][0] for r in range(4)), results
