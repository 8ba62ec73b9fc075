"""A plan searched for a GPT without the residual stream (AutoDDL's graph, ``"residual": false``: the gpt presets
autoddl-* and gpt3-*) applied to a GPT that adds one (the reference modules built with it, transformers'
GPT-2): a Megatron 3-D plan's first stage ends in fc2's row-parallel partial sum, which the module's residual add
counts once per device. ``apply_pipeline`` refuses it in one line on every rank before any weight moves (with
the check taken out, the losses differ from one process: the refusal guards a wrong run), and takes a plan of
the same graph whose stream is one placement and no partial sum (every stage replicated), whose losses and
weights then agree with one process (1e-9, float64); ``apply`` refuses a single-stage plan whose norms take the
stream in different placements (the residual add would join a piece of the batch with the whole). One launch of
4 gloo processes (about 15 s on the shared 2-core box)."""
import os
from dataclasses import replace
from unittest import mock

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)

from apply_plans import GPT as SMALL, data_parallel, typed_plan  # noqa: E402
from gloo_runner import run_on_gloo  # noqa: E402
from pipeline_exec_plans import (GPT, GPT_PLAIN, make_model, megatron, replicated, restage,  # noqa: E402
                                 train_one_process)
from test_pipeline_exec import mismatch, train_pipelined  # noqa: E402

from autotune.apply import pipeline as stages_module  # noqa: E402
from autotune.apply.layers import check_stream  # noqa: E402
from autotune.apply.pipeplan import _stream  # noqa: E402
from autotune.plan import FineMesh  # noqa: E402
from autotune.sbp.mesh import Cluster  # noqa: E402
from calibrate.errors import UserError  # noqa: E402

CFG, PLAIN = dict(GPT, batch=8), dict(GPT_PLAIN, batch=8)
M = 4  # micro-batches of 2 sequences: whole sequences on each stage's 2 tensor-parallel devices


def _partial_plan():
    """The Megatron 3-D plan of the GPT without the residual stream: 2 stages of one 2-GPU node, t = 2."""
    plan = megatron(PLAIN, 2, 2, 2, 2, M)
    assert plan.stages[0].plan.layers[-1].name == "fc2" and _stream(plan.stages[0].plan)[1][-1] == "P"
    assert not any(lay.kind == "residual" for s in plan.stages for lay in s.plan.layers)
    return plan


def _uneven_plan():
    """A single-stage plan of the GPT without the residual stream on 2 x 2: data parallel, but ln2 takes the
    stream split over the first axis only (the residual add would join one sequence with two)."""
    cfg = dict(SMALL, residual=False)
    plan = typed_plan(cfg, 2, 2, data_parallel(cfg), "uneven")
    layers = tuple(replace(lay, input=("S0", "B")) if lay.name == "ln2" else lay
                   for lay in plan.layers if lay.kind != "residual")
    return replace(plan, layers=layers)


def _small_gpt(residual: bool):
    from models.modules import build
    return build(dict(SMALL, residual=residual, attention="flash", bias=True, positions="learned"))


def test_which_plans_and_modules_are_refused():
    import transformers as tf
    plan = _partial_plan()
    ends = [_stream(s.plan)[1] for s in plan.stages[:-1]] + [None]
    for model in (make_model(CFG), tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=4, n_head=4))):
        with pytest.raises(UserError, match=r"its stage 0 hands .*partial sum at the stage's end .*\"residual\": true"):
            check_stream(plan.stages[0].plan, model, ends[0], "its stage 0")
        check_stream(plan.stages[1].plan, model, None, "its stage 1")  # the last stage hands its stream on whole
    for stage, end in zip(plan.stages, ends):
        check_stream(stage.plan, make_model(PLAIN), end)  # the module the plan was searched for
    whole = restage(restage(plan, 0, replicated), 1, replicated)
    for stage, end in zip(whole.stages, [_stream(s.plan)[1] for s in whole.stages[:-1]] + [None]):
        check_stream(stage.plan, make_model(CFG), end)  # one placement, no partial sum: runs as planned
    uneven = _uneven_plan()
    with pytest.raises(UserError, match=r"\['S0', 'S0'\] at ln1 but as \['S0', 'B'\] at ln2"):
        check_stream(uneven, _small_gpt(True))
    check_stream(uneven, _small_gpt(False))
    one = replace(uneven, cluster=Cluster(1, 1), mesh=FineMesh.of(Cluster(1, 1)),
                  layers=tuple(replace(lay, input=("B",) if lay.name == "ln2" else lay.input and lay.input[:1],
                                       output=lay.output and lay.output[:1],
                                       weights=tuple(replace(w, placements=w.placements[:1]) for w in lay.weights))
                               for lay in uneven.layers))
    check_stream(one, _small_gpt(True))  # on one device the placements name no split
    residual = typed_plan(dict(SMALL, residual=True), 2, 2, data_parallel(SMALL), "data parallel")
    check_stream(replace(residual, layers=tuple(replace(lay, input=("S0", "B")) if lay.name == "ln2" else lay
                                                for lay in residual.layers)), _small_gpt(True))


def _run(kind, plan):
    """The pipelined plan trained, or (kind "apply") the single-stage plan applied; a refusal, or a wrong run's
    own failure, as its line."""
    import autotune
    if kind == "apply":
        model = _small_gpt(True)
        autotune.apply(plan, model, mapping=model.plan_mapping)
        return "applied"
    return train_pipelined(CFG, plan)


def test_refused_before_it_trains_wrong():
    plan = _partial_plan()
    whole = restage(restage(plan, 0, replicated), 1, replicated)
    jobs = [("pipeline", plan, None), ("pipeline", plan, "unchecked"), ("pipeline", whole, None),
            ("apply", _uneven_plan(), None)]
    # the planted bug: the check taken out
    results = run_on_gloo(_run, jobs, bugs={"unchecked": lambda: mock.patch.object(
        stages_module, "check_stream", lambda *a, **k: None)})
    ref = train_one_process(CFG, M)
    assert ref[0][1] != pytest.approx(ref[0][0])  # the loss moved
    refused = [results[r][0] for r in range(4)]
    assert all(isinstance(x, str) and x == refused[0] for x in refused) and refused[0].startswith(
        "UserError: the plan was searched") and "its stage 0 hands" in refused[0], "the plan was not refused alike"
    assert any(mismatch(ref, results[r][1]) for r in range(4)), "without the check the run is right: no guard needed"
    assert not any(mismatch(ref, results[r][2]) for r in range(4)), [mismatch(ref, results[r][2]) for r in range(4)]
    single = [results[r][3] for r in range(4)]
    assert all(x == single[0] for x in single) and "at ln1 but as" in single[0], single
