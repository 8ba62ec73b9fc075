"""FSDP with the embedding's table split by columns (the search's plan for untied Llama-style models on 2 x H200:
session 33) runs on the fully_shard path, as a pipeline's first stage does (``autotune.plan.layouts.column_twin``,
``autotune.apply.vocab.place_columns``): on 4 gloo processes (float64) the losses of every step and every parameter
after two Adam steps agree with one process to 1e-9, FSDP over both fine axes and HSDP with full recomputation;
the plan's path is priced and placed alike (the step model reads ``plan_path``). A tied table keeps the DTensor
path; tune counts the plan as one of per-layer placements (plain FSDP measured beside it). Planted: the table's
gradient left unscaled (the sum of the pieces', not their mean) disagrees."""
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)
from dataclasses import replace  # noqa: E402

from autotune.plan.layouts import column_twin, plan_path  # noqa: E402
from gloo_runner import run_on_gloo  # noqa: E402
from apply_plans import LLAMA, data_parallel, typed_plan  # noqa: E402
from test_apply_distributed import make_model, mismatch, train  # noqa: E402


def columns_plan(name: str, **kw):
    placements = data_parallel(LLAMA)
    placements["embedding"] = (None, ("S1", "S1"), {"weight": ("S1", "S1")})
    return typed_plan(LLAMA, 2, 2, placements, name, **kw)


PLANS = [columns_plan("FSDP, the embedding by columns", fsdp_axes=(0, 1)),
         columns_plan("HSDP, the embedding by columns", recompute="full", fsdp_axes=(1,))]


def _run(kind, plan, unscaled=False):
    import autotune
    from autotune.apply import vocab
    if unscaled:
        lookup = vocab._column_lookup
        vocab._column_lookup = lambda ids, **kw: lookup(ids, **dict(kw, factor=1.0))
    model = autotune.apply(plan, make_model(kind))
    return model._autotune_path, train(model, plan, LLAMA)


def _unscaled(kind, plan):
    return _run(kind, plan, unscaled=True)


def test_the_column_embedding_plans_take_fully_shard_and_a_tied_one_dtensor():
    from autotune.execute.tune import kind_of
    assert all(column_twin(p) is not None and plan_path(p) == "fully_shard" for p in PLANS)
    # tune measures plain FSDP beside it: another kind of candidate
    assert [kind_of(replace(p, apply_path=plan_path(p))) for p in PLANS] == ["per-layer placements"] * 2
    tied = replace(PLANS[0], model=replace(PLANS[0].model, config=dict(PLANS[0].model.config, tied=True)))
    assert column_twin(tied) is None and plan_path(tied) == "dtensor"


def test_the_column_embedding_plans_match_one_process():
    results = run_on_gloo(_run, [("llama", p) for p in PLANS])[0]
    ref = train(make_model("llama"), PLANS[0], LLAMA)
    for plan, got in zip(PLANS, results):
        assert not isinstance(got, str), got
        path, got = got
        assert path == "fully_shard", (plan.strategy, path)
        assert mismatch(ref, got) is None, f"{plan.strategy}: {mismatch(ref, got)}"
    bad = run_on_gloo(_unscaled, [("llama", PLANS[0])])[0][0]
    assert not isinstance(bad, str) and mismatch(ref, bad[1]) is not None, "an unscaled table gradient went unnoticed"
