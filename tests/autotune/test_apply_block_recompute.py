"""Megatron-LM's block recomputation as apply runs it (a plan's ``recompute_blocks``, ``autotune.apply.layers.
_recompute``): only the first N blocks are checkpointed, on the DDP, tensor-parallel and DTensor paths, and two Adam
steps on 2 gloo processes match one process in float64. A count at or above the blocks a model has is one line
before any weight moves. Planted bug (shown once): ``_recompute`` ignoring the count checkpoints every block and
fails the first test."""
import dataclasses
import functools
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402,F401

from apply_plans import LLAMA, data_parallel, random_partial, tp_data, typed_plan  # noqa: E402
from gloo_runner import run_on_gloo  # noqa: E402
from test_apply_distributed import mismatch, train  # noqa: E402
from test_apply_property import build  # noqa: E402

CFG = dict(LLAMA, layers=3)


def _checkpointed(model) -> list[bool]:
    from autotune.apply.layers import _rerun
    return [isinstance(m.forward, functools.partial) and m.forward.func is _rerun
            for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]


def _run(plan):
    import autotune
    model = autotune.apply(plan, build("llama", CFG))
    return model._autotune_path, _checkpointed(model), train(model, plan, CFG)


def _blocks(plan, n: int):
    return dataclasses.replace(plan, recompute="full", recompute_blocks=n, sharding_mode="none", sharding_axes=())


def test_the_first_blocks_rerun_and_the_step_matches_one_process():
    plans = {"ddp": _blocks(typed_plan(CFG, 1, 2, data_parallel(CFG, axes=1), "data parallel"), 2),
             "tensor": _blocks(typed_plan(CFG, 1, 2, tp_data(CFG, axes=1, tp=1), "tensor parallel"), 1),
             "dtensor": _blocks(typed_plan(CFG, 1, 2, random_partial(CFG, (2,), 0), "per-layer placements"), 1)}
    results = run_on_gloo(_run, [(p,) for p in plans.values()], world=2)[0]
    want = train(build("llama", CFG), plans["ddp"], CFG)
    for (name, plan), got in zip(plans.items(), results):
        assert not isinstance(got, str), (name, got)
        path, rerun, trained = got
        assert path == name, (name, path)
        assert rerun == [i < plan.recompute_blocks for i in range(CFG["layers"])], (name, rerun)
        assert mismatch(want, trained) is None, (name, mismatch(want, trained))


def test_more_blocks_than_the_model_has_is_one_line():
    import autotune
    from calibrate.errors import UserError
    plan = _blocks(typed_plan(CFG, 1, 1, data_parallel(CFG, axes=1), "one device"), CFG["layers"] + 1)
    with pytest.raises(UserError, match="re-runs the first 4 blocks, but this part of the model has 3"):
        autotune.apply(plan, build("llama", CFG))
