"""autotune.apply_pipeline on 4 processes (gloo, float64) against the same model in one process: the loss of
every step and every parameter after two Adam steps agree to 1e-9 (relative), for a small GPT (reference
modules, tied embedding and logits: their gradients summed between the first and the last stage) and a small
Hugging Face Llama, with the pipeline search's plans as 2 stages x 2 devices and 4 stages x 1; on 2 x 2 also
plans whose second (first, under eager-1F1B) stage replicates everything (the boundary reshards the
data-parallel stream S0 -> B (B -> S0) and its gradient back) and one whose second stage declares the
arriving stream a partial sum while its blocks compute it split (a wrong boundary placement), which fails;
on 4 x 1 also GPipe and eager-1F1B plans. A partial-sum boundary (a Megatron 3-D plan of a GPT without the
residual stream, t = 2: stage 0 ends in fc2's row-parallel output, P; stage 1 takes it replicated) on
2 x 2 by each route (direct: the whole partial tile sent, reduced on the receiver; scatter: reduce-scattered
on the sender to the features or to the sequences, then all-gathered on the receiver), and a deliberately
wrong route (the partial pieces sent unreduced), which fails; and 3-D plans of fewer micro-batches than
stages (4 x 1, m = 2) under 1F1B (Megatron's order, on the library's runtime) and eager-1F1B, each stage's
forwards and backwards in the step model's order. Each stage keeps the micro-batches in flight that the plan's
schedule says (counted at run time). One launch per model and layout (each 3-45 s on the shared 2-core
box)."""
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

from pipeline_exec_plans import (GPT, GPT_PLAIN, LLAMA, adam_steps, make_model, megatron,  # noqa: E402
                                 replicated, rerouted, restage, searched, stage_parameters,
                                 train_one_process)
from gloo_runner import run_on_gloo  # noqa: E402

from autotune.apply import pipeline as stages_module  # noqa: E402

RTOL = 1e-9
_RESHARD = stages_module._reshard_stream


def _unreduced(x, mesh, src, dst):
    """A deliberately wrong route: the sending stage's partial sum read as whole, so its pieces leave unreduced."""
    return _RESHARD(x, mesh, None if src is None else tuple("B" if p == "P" else p for p in src), dst)


def _count_in_flight(module) -> dict:
    """The micro-batches whose forward ran and whose backward has not reached the stage's output yet: now
    and at most; and the order of the stage's forwards (F) and backwards (B, as they reach its output)."""
    count = {"now": 0, "peak": 0, "order": []}

    def done(grad):
        count["now"] -= 1
        count["order"].append("B")

    def forward(mod, args, out):
        count["now"] += 1
        count["peak"] = max(count["peak"], count["now"])
        count["order"].append("F")
        out.register_hook(done)
    module.register_forward_hook(forward)
    return count


def train_pipelined(cfg: dict, plan: dict) -> tuple[list, dict, int, list]:
    """STEPS Adam steps of this rank's stage: (losses, this stage's parameters whole, by the model's names, the
    most micro-batches it kept in flight, the order of its forwards and backwards), the last two over the last
    step."""
    import autotune
    model = make_model(cfg)
    names = {id(m): n for n, m in model.named_modules()}
    pipe = autotune.apply_pipeline(plan, model)
    in_flight = _count_in_flight(pipe.module)
    # counted over the last step (the first one's also infers shapes)
    losses = adam_steps(pipe, cfg, before=lambda: in_flight.update(now=0, peak=0, order=[]))
    params = stage_parameters(pipe.module, names)
    return losses, params, in_flight["peak"], in_flight["order"]


def _launch(jobs) -> list[list]:
    """(cfg, plan, "unreduced" or None: the wrong route) jobs on 4 gloo processes: each rank's results."""
    return run_on_gloo(train_pipelined, jobs, bugs={
        "unreduced": lambda: mock.patch.object(stages_module, "_reshard_stream", _unreduced)})


def partial_stream(name: str, key: str, fine: tuple) -> tuple:
    """The residual stream declared to arrive as a partial sum (its blocks still compute it split)."""
    return tuple("P" if p == "S0" else p for p in fine) if (name, key) == ("residual", "input") else fine


def mismatch(ref, got) -> str | None:
    """Where the pipelined run differs from one process (None: it agrees)."""
    if isinstance(got, str):
        return got
    (ref_losses, ref_params), (losses, params) = ref, got[:2]
    if not np.allclose(losses, ref_losses, rtol=RTOL, atol=0):
        return f"losses {losses} != {ref_losses}"
    for name, have in params.items():
        want = ref_params.get(name)
        if want is None:
            return f"parameter {name} is not the model's"
        if not torch.allclose(have, want, rtol=RTOL, atol=RTOL):
            return f"parameter {name} differs by {(have - want).abs().max():.3g}"
    return None


def jobs_for(kind: str, stages: int) -> list[tuple[dict, dict, bool]]:
    """(model config, pipelined plan, whether it must agree with one process): the search's plan, and on 2 x 2
    plans whose second or first (eager-1F1B) stage replicates everything (GPT) or whose second stage declares
    the arriving stream partial (Llama); on 4 x 1 the other schedules."""
    # 2 x 2: a batch of 32, so that the micro-batches of the search's plan split into whole sequences per device
    cfg = dict(GPT if kind == "gpt" else LLAMA, batch=32 if stages == 2 else 8)
    plan = searched(cfg, stages)
    if stages == 2:
        assert plan.stages[0].plan.layers[5].output[-1] == "S0"  # split data
        if kind == "gpt":  # the boundary reshards S0 -> B, and B -> S0 (under eager-1F1B)
            return [(cfg, plan, True), (cfg, restage(plan, 1, replicated), True),
                    (cfg, restage(searched(cfg, stages, schedule="eager-1f1b"), 0, replicated), True)]
        return [(cfg, plan, True), (cfg, restage(plan, 1, partial_stream), False)]
    return [(cfg, plan, True), (cfg, searched(cfg, stages, schedule="gpipe" if kind == "gpt" else "eager-1f1b"), True)]


@pytest.mark.parametrize("kind,stages", [("gpt", 2), ("llama", 2), ("gpt", 4), ("llama", 4)])
def test_pipeline_matches_one_process(kind, stages):
    jobs = jobs_for(kind, stages)
    results = _launch([(c, p, None) for c, p, _ in jobs])
    cfg = jobs[0][0]
    ref = train_one_process(cfg, jobs[0][1].micro_batches)
    assert ref[0][1] != pytest.approx(ref[0][0])  # the loss moved between the steps
    for k, (_, plan, ok) in enumerate(jobs):
        problems = [mismatch(ref, results[r][k]) for r in range(4)]
        if not ok:
            assert any(problems), "a wrong boundary placement went unnoticed"
            continue
        assert not any(problems), f"{kind} {plan.strategy}: {[p for p in problems if p]}"
        seen = {name for r in range(4) for name in results[r][k][1]}
        assert seen == set(ref[1]), f"parameters no stage trained: {sorted(set(ref[1]) - seen)}"
        # the executed schedule keeps what the step model says (1F1B p - i, eager 2(p - i) - 1, GPipe m)
        per_rank = [s.inflight for s in plan.stages for _ in range(4 // stages)]
        assert [results[r][k][2] for r in range(4)] == per_rank, plan.pipeline.schedule


def _check(ref, results, jobs, stages: int, label: str) -> None:
    for k, (_, plan, ok, *_) in enumerate(jobs):
        problems = [mismatch(ref, results[r][k]) for r in range(4)]
        if not ok:
            assert any(problems), f"{label}: a wrong route went unnoticed"
            continue
        assert not any(problems), f"{label} {plan.strategy}: {[p for p in problems if p]}"
        per_rank = [s.inflight for s in plan.stages for _ in range(4 // stages)]
        assert [results[r][k][2] for r in range(4)] == per_rank, plan.pipeline.schedule


def test_partial_sum_boundary_by_each_route():
    cfg = dict(GPT_PLAIN, batch=32)
    plan = megatron(cfg, 2, 2, 2, 2, 16)  # 2 stages of one 2-GPU node, t = 2, 16 micro-batches of 2 sequences
    last = plan.stages[0].plan.layers[-1]
    assert last.name == "fc2" and last.output[-1] == "P"  # the stream leaves partial
    assert plan.stages[0].boundary_route == "direct"  # tiny tiles: the extra collective's latency loses
    scatter = rerouted(plan, 0, "scatter", ["S1"])
    jobs = [(cfg, plan, True, None), (cfg, scatter, True, None),
            (cfg, rerouted(plan, 0, "scatter", ["S0"]), True, None), (cfg, scatter, False, "unreduced")]
    results = _launch([(c, p, w) for c, p, _, w in jobs])
    ref = train_one_process(cfg, 16)
    assert ref[0][1] != pytest.approx(ref[0][0])
    _check(ref, results, jobs, 2, "partial-sum boundary")


def test_fewer_micro_batches_than_stages():
    # 3-D plans of 4 stages of one device and 2 micro-batches: 1F1B as Megatron runs it (stage i: min(p - i, m)
    # forwards before its first backward), which torch's Schedule1F1B refuses, and eager-1F1B
    plans = [megatron(GPT, 4, 1, 4, 1, 2), megatron(GPT, 4, 1, 4, 1, 2, schedule="eager-1f1b")]
    assert [p.pipeline.schedule for p in plans] == ["1f1b", "eager-1f1b"]
    assert [s.inflight for s in plans[0].stages] == [2, 2, 2, 1]
    jobs = [(GPT, plan, True, None) for plan in plans]
    results = _launch([(c, p, w) for c, p, _, w in jobs])
    _check(train_one_process(GPT, 2), results, jobs, 4, "m < p")
    # each stage's forwards and backwards, as they ran, in the order of the step model's timeline
    for k, plan in enumerate(plans):
        for r, s in enumerate(plan.stages):
            timeline = [kind for kind, *_ in sorted(s.timeline, key=lambda iv: iv[2]) if kind in ("F", "B")]
            assert results[r][k][3] == timeline, (plan.pipeline.schedule, r)
    assert [results[r][0][3] for r in (0, 3)] == [["F", "F", "B", "B"], ["F", "B", "F", "B"]]
