"""Interleaved 1F1B as apply runs it (Megatron-LM's virtual pipeline stages: ``autotune.apply.pipeplan``
``Plan.chunk_ranges``, torch's ``ScheduleInterleaved1F1B``): the pipeline search's interleaved plans (2 chunks a rank)
on 4 gloo processes, as 2 stages x 2 devices (a small GPT with a tied embedding and logits, and a small Hugging
Face Llama, one block a chunk) and as 4 stages x 1 (an 8-block GPT, also with block recomputation of each rank's
first block), agree with one process to 1e-9 (relative): the loss of every step and every parameter after two
Adam steps. Each rank runs its chunks' forwards and backwards in the order the step model simulates
(``autotune.reshard.pipeline.interleaved_orders``), observed on the chunks' modules. A plan whose micro-batches
are not a multiple of its stages, or whose chunks a rank leave a stage without a block, is one line before any
weight moves. Planted bug (shown once): the chunks laid along the model rank by rank instead of in virtual stage
order fails the agreement test."""
import dataclasses
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)
import transformers  # noqa: E402,F401

from pipeline_exec_plans import (GPT, LLAMA, adam_steps, make_model, searched, stage_parameters,  # noqa: E402
                                 train_one_process)
from gloo_runner import run_on_gloo  # noqa: E402
from test_pipeline_exec import mismatch  # noqa: E402

INTERLEAVED = "interleaved-1f1b"


def _watch(parts) -> list:
    """Each chunk's forwards (F) and backwards (B, as they reach its output), with its virtual stage, in order."""
    order = []
    for s, part in parts:
        def forward(mod, args, out, s=s):
            order.append(("F", s))
            out.register_hook(lambda grad: order.append(("B", s)))
        part.register_forward_hook(forward)
    return order


def train_interleaved(cfg: dict, plan) -> tuple[list, dict, list]:
    """STEPS Adam steps of this rank's chunks: (losses, their parameters whole by the model's names, the order of
    their forwards and backwards over the last step)."""
    import autotune
    model = make_model(cfg)
    names = {id(m): n for n, m in model.named_modules()}
    pipe = autotune.apply_pipeline(plan, model)
    p = len(plan.stages)
    order = _watch([(pipe.stage + k * p, part) for k, part in enumerate(pipe.chunks)])
    losses = adam_steps(pipe, cfg, before=order.clear)  # the order over the last step (the first infers shapes)
    params = {}
    for part in pipe.chunks:
        params.update(stage_parameters(part, names))
    return losses, params, list(order)


def _rerun_first_block(plan):
    """``plan`` with each stage re-running its first block only (Megatron-LM's block recomputation)."""
    return dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(s, plan=dataclasses.replace(s.plan, recompute="full", recompute_blocks=1,
                                                        sharding_mode="none", sharding_axes=()))
        for s in plan.stages))


def jobs() -> list:
    gpt8 = dict(GPT, layers=8, batch=16)
    return [(dict(GPT, batch=32), searched(dict(GPT, batch=32), 2, schedule=INTERLEAVED)),
            (dict(LLAMA, batch=32), searched(dict(LLAMA, batch=32), 2, schedule=INTERLEAVED)),
            (gpt8, searched(gpt8, 4, nodes=4, gpus=1, schedule=INTERLEAVED)),
            (gpt8, _rerun_first_block(searched(gpt8, 4, nodes=4, gpus=1, schedule=INTERLEAVED)))]


def test_interleaved_matches_one_process_in_the_step_models_order():
    from autotune.reshard.pipeline import interleaved_orders
    todo = jobs()
    for cfg, plan in todo:
        assert plan.pipeline.schedule == INTERLEAVED and plan.virtual_stages == 2
        assert plan.micro_batches % len(plan.stages) == 0
    # 4 stages x 1 of 8 blocks: rank i runs blocks i and i + 4
    assert todo[2][1].chunk_ranges() == [(i, i + 1) for i in range(8)]
    assert todo[0][1].chunk_ranges() == [(0, 1), (1, 2), (2, 3), (3, 4)]
    results = run_on_gloo(train_interleaved, todo)
    for k, (cfg, plan) in enumerate(todo):
        ref = train_one_process(cfg, plan.micro_batches)
        assert ref[0][1] != pytest.approx(ref[0][0])  # the loss moved between the steps
        problems = [mismatch(ref, results[r][k]) for r in range(4)]
        assert not any(problems), f"job {k} {plan.strategy}: {[x for x in problems if x]}"
        seen = {name for r in range(4) for name in results[r][k][1]}
        assert seen == set(ref[1]), f"parameters no chunk trained: {sorted(set(ref[1]) - seen)}"
        p = len(plan.stages)
        orders = interleaved_orders(p, plan.virtual_stages, plan.micro_batches)
        for r in range(4):
            want = [(kind, s) for kind, _, s in orders[r // (4 // p)]]
            assert results[r][k][2] == want, (k, r)


def test_plans_interleaving_cannot_run_are_one_line():
    from autotune.apply.pipeplan import load_pipelined
    from calibrate.errors import UserError
    cfg = dict(GPT, batch=32)
    plan = searched(cfg, 2, schedule=INTERLEAVED)
    odd = dataclasses.replace(plan, micro_batches=plan.micro_batches + 1)
    with pytest.raises(UserError, match="micro-batches in groups of the 2 stages"):
        load_pipelined(odd)
    three = dataclasses.replace(plan, stages=tuple(dataclasses.replace(
        s, techniques=dict(s.techniques, virtual_stages=3)) for s in plan.stages))
    with pytest.raises(UserError, match="at least one block a chunk"):
        load_pipelined(three)
    plain = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, schedule="1f1b"))
    with pytest.raises(UserError, match="2 chunks a rank under 1f1b"):
        load_pipelined(plain)
