"""Tensor-parallel stages and the last stage's loss of the step users run: ``autotune.apply_pipeline`` on 4
processes (gloo, float64) against the same model in one process (the loss of every step on every rank and every
parameter after two Adam steps, to 1e-9 relative), for a small Hugging Face Llama:

- Megatron's 3-D plan (2 stages of t = 2) takes the tensor path on both stages (torch's ParallelStyles on the
  stage's tensor axis, torchtitan's PP + TP), its logits split by vocabulary a DTensor of columns whose cross
  entropy runs under ``loss_parallel``; nothing gathers them;
- the same plan and the search's 2 x 2 plan (data-parallel stages) forced onto the DTensor path: its last stage's
  logits are those of this rank's piece of the micro-batch (split by the batch; by vocabulary as the plan says),
  not the whole micro-batch's;
- a user's ``loss_fn`` takes the logits gathered by vocabulary (its own piece of the batch).

- Megatron's plan with data and tensor axes in each stage (2 stages of d = 2 x t = 2, 8 processes): each rank
  its piece of the micro-batch in its vocabulary columns.

Each rank reports the path its stage took and the shape of the logits its last stage handed to the loss.
Planted bugs fail: the schedule not under ``loss_parallel``, the DTensor path's logits gathered whole (its
``Ends`` of the last stage as the first's), every rank's loss taken against the first piece of the targets, the
pieces' losses not averaged over the stage's data ranks."""
import os
from unittest import mock

import numpy as np
import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)
import transformers  # noqa: E402,F401

from gloo_runner import run_on_gloo  # noqa: E402
from pipeline_exec_plans import (LLAMA, adam_steps, in_micro_batches, make_model, megatron,  # noqa: E402
                                 check_ranks, searched, stage_parameters, train_one_process)

from autotune.apply import pipeline as stages_module  # noqa: E402
from autotune.apply.batch import DataSplit  # noqa: E402
from autotune.apply.cuts import WHOLE  # noqa: E402

RTOL = 1e-9
M = 4  # micro-batches of 8 sequences (batch 32)
CFG = dict(LLAMA, batch=32)
_PIECE = stages_module._piece_loss


def _uncut(x, target, *, loss_fn, split):
    """A planted bug: every rank's logits against the first piece of the micro-batch's targets."""
    return _PIECE(x, target, loss_fn=loss_fn, split=DataSplit(0, split.world))


def _unaveraged(*args, **kwargs):
    """A planted bug: the pieces' losses reported without the mean over the stage's data ranks."""
    pipe = _APPLY(*args, **kwargs)
    pipe.data_groups = ()
    return pipe


_APPLY = stages_module.apply_pipeline
BUGS = {"no-loss-parallel": lambda: mock.patch.object(stages_module, "vocabulary_columns", lambda *a: False),
        "gathered": lambda: mock.patch.object(stages_module.Ends, "of", staticmethod(lambda plan: WHOLE)),
        "uncut": lambda: mock.patch.object(stages_module, "_piece_loss", _uncut),
        "unaveraged": lambda: mock.patch.object(stages_module, "apply_pipeline", _unaveraged)}


def _user_loss(logits, targets):
    assert not isinstance(logits, torch.distributed.tensor.DTensor)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_pipelined(plan, local: bool, user_loss: bool):
    """STEPS Adam steps of this rank's stage: (losses, its parameters whole by the model's names, the path it
    took, the global and local shape of the logits its last stage hands to the loss)."""
    from torch.distributed.tensor import DTensor
    model = make_model(CFG)
    names = {id(m): n for n, m in model.named_modules()}
    pipe = stages_module.apply_pipeline(plan, model, loss_fn=_user_loss if user_loss else None, local=local)
    shapes = []
    pipe.module.register_forward_hook(lambda m, a, out: shapes.append(
        (tuple(out.shape), tuple(out.to_local().shape) if isinstance(out, DTensor) else tuple(out.shape))))
    losses = adam_steps(pipe, CFG)
    params = stage_parameters(pipe.module, names)
    return losses, params, pipe.path, shapes[-1] if pipe.last else None


def mismatch(ref, got, path: str, logits) -> str | None:
    if isinstance(got, str):
        return got
    losses, params, took, shape = got
    if took != path:
        return f"the stage took the {took} path, not {path}"
    if shape is not None and shape != logits:
        return f"the last stage's logits are {shape} (global, local), not {logits}"
    for name, x in params.items():
        if name not in ref[1]:
            return f"parameter {name} is not the model's"
        if not torch.allclose(x, ref[1][name], rtol=RTOL, atol=RTOL):
            return f"parameter {name} differs by {(x - ref[1][name]).abs().max():.3g}"
    if not np.allclose(losses, ref[0], rtol=RTOL, atol=0):
        return f"losses {losses} != {ref[0]}"
    return None


def test_tensor_stages_and_the_last_stages_piece():
    from autotune.apply.pipeplan import load_pipelined, stage_paths
    mb, seq, vocab = CFG["batch"] // M, CFG["sequence"], CFG["vocabulary"]
    tp = megatron(CFG, 2, 2, 2, 2, M)  # 2 stages of one 2-device node, t = 2
    assert tp.stages[-1].plan.layer("logits").weight("weight").placements[-1] == "S1"  # by vocabulary
    dp = in_micro_batches(searched(CFG, 2), M)
    assert stage_paths(load_pipelined(dp)) == ["ddp", "ddp"]
    assert stage_paths(load_pipelined(tp)) == ["tensor", "tensor"]
    by_vocab = ((mb, seq, vocab), (mb, seq, vocab // 2))  # every sequence of the micro-batch, half the columns
    by_batch = ((mb // 2, seq, vocab),) * 2  # this rank's piece of the micro-batch, every column
    whole = ((mb, seq, vocab),) * 2
    # (plan, local path, the user's loss, bug, the paths, the last stage's logits)
    jobs = [(tp, True, False, None, "tensor", by_vocab), (tp, True, True, None, "tensor", by_vocab),
            (tp, False, False, None, "dtensor", by_vocab), (dp, False, False, None, "dtensor", by_batch),
            (dp, False, True, None, "dtensor", by_batch),
            (tp, False, False, "gathered", "dtensor", by_vocab), (dp, False, False, "gathered", "dtensor", by_batch),
            (dp, False, False, "uncut", "dtensor", by_batch), (dp, False, False, "unaveraged", "dtensor", by_batch),
            (tp, True, False, "no-loss-parallel", "tensor", by_vocab)]  # last: it fails on the last stage alone
    assert by_batch != whole
    results = run_on_gloo(train_pipelined, [j[:4] for j in jobs], bugs=BUGS, timeout=60)
    ref = train_one_process(CFG, M)
    assert ref[0][1] != pytest.approx(ref[0][0])  # the loss moved between the steps
    for k, (plan, local, user, bug, path, logits) in enumerate(jobs):
        problems = [mismatch(ref, results[r][k], path, logits) for r in range(4)]
        check_ranks(problems, bug, results, k, ref[1], f"{plan.strategy} local={local} user loss={user}")


def test_data_by_tensor_stages():
    """Megatron's 3-D plan with both axes in each stage (2 stages of d = 2 x t = 2, 8 processes): each rank the
    logits of its piece of the micro-batch in its vocabulary columns, and one process's training."""
    mb, seq, vocab = CFG["batch"] // M, CFG["sequence"], CFG["vocabulary"]
    plan = megatron(CFG, 2, 4, 2, 2, M)
    assert [s.plan.mesh.sizes for s in plan.stages] == [(2, 2)] * 2
    results = run_on_gloo(train_pipelined, [(plan, True, False, None)], 8, bugs=BUGS, timeout=60)
    ref = train_one_process(CFG, M)
    logits = ((mb // 2, seq, vocab), (mb // 2, seq, vocab // 2))
    problems = [mismatch(ref, results[r][0], "tensor", logits) for r in range(8)]
    assert not any(problems), [p for p in problems if p]
