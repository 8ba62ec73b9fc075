"""The step-time objective: compute from the profile's compute model plus the communication not hidden,
against closed forms on small cases."""
import dataclasses
import math

import numpy as np
import pytest

from calibrate.collectives import Collective
from calibrate.compute import Band, ComputeModel
from calibrate.errors import UserError
from calibrate.profile import Group, Profile
from models import load_model
from autotune.__main__ import main as autotune_main
from autotune.sbp.baselines import data_parallel, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.plan.build import build as build_plan
from autotune.sbp.search import Budget, make_search

BASE = Profile.load("gcp-a100")
PEAK, LAUNCH, BW = 1e14, 1e-6, 1e12
EW_BW, ADAM_BW = BW / 2, BW / 4  # elementwise kernels and fused Adam: each its own bandwidth
CM = ComputeModel("test: peak-rate model", "assumed", LAUNCH, BW, matmul={"2": Band(PEAK)}, attention={"2": Band(PEAK)},
                  op_Bps={"elementwise": EW_BW, "optimizer": ADAM_BW})
PROFILE = dataclasses.replace(BASE, compute=CM)
DIMS = [256, 512, 128]
T, MB = 64, 2  # tokens per micro-batch, micro-batches


def mm(m, k, n):
    return LAUNCH + 2 * m * k * n / PEAK


def mem(nbytes):
    return LAUNCH + nbytes / EW_BW


def copy(nbytes):
    return LAUNCH + nbytes / BW


def adam(nbytes):
    return LAUNCH + nbytes / ADAM_BW


def mlp_problem(objective="step", profile=PROFILE):
    g = load_model("mlp", None, {"dims": DIMS, "batch": T * MB, "micro_batch": T})
    return Problem(g, Coster(profile, Cluster(1, 4)), None, objective=objective)


def test_data_parallel_step_closed_form():
    # 4 GPUs, data parallel: each matmul on T/4 tokens forward, twice that backward; the loss memory-bound
    # (the executed cross-entropy: 2 + 9 x 4 bytes a logit forward, 3 x 4 + 2 backward, T/4 x 128 logits);
    # bf16 autocast over fp32 parameters: per micro-batch each weight cast to bf16 forward (6 bytes a
    # parameter) and its bf16 gradient to fp32 backward (6); fused AdamW moves 28 bytes a parameter once
    # a step; the second micro-batch's fp32 gradients are added to the first's (3 x 4 bytes a parameter).
    # The fp32 gradient all-reduces (S) hide behind the last micro-batch's backward (W) except for the
    # first layer's, ready last (F): exposed max(S - W, F).
    pr = mlp_problem()
    a = data_parallel(pr)
    fwd = [mm(T // 4, k, n) + mem(6 * k * n) for k, n in zip(DIMS, DIMS[1:])]
    bwd = [2 * mm(T // 4, k, n) + mem(6 * k * n) for k, n in zip(DIMS, DIMS[1:])]
    logits = T // 4 * DIMS[-1]
    loss_f, loss_b = mem(logits * (2 + 9 * 4)), mem(logits * (3 * 4 + 2))
    opt = sum(adam(k * n * 28) for k, n in zip(DIMS, DIMS[1:]))  # fused AdamW on the fp32 weights
    accumulate = (MB - 1) * sum(mem(3 * k * n * 4) for k, n in zip(DIMS, DIMS[1:]))
    compute = MB * (sum(fwd) + sum(bwd) + loss_f + loss_b) + opt + accumulate
    syncs = [BASE.time(Collective.ALLREDUCE, k * n * 4, Group(4)) for k, n in zip(DIMS, DIMS[1:])]
    W = sum(bwd) + loss_b
    exposed = max(sum(syncs) - W, syncs[0])
    t = build_plan(pr, a, "dp").costs.to_dict()
    assert t["compute_s"] == pytest.approx(compute, rel=1e-12)
    assert t["exposed_comm_s"] == pytest.approx(exposed, rel=1e-12)
    assert t["step_s"] == pytest.approx(compute + exposed, rel=1e-12)
    assert pr.cost(a) == pytest.approx(compute + exposed, rel=1e-12)
    assert t["total_s"] == pytest.approx(sum(syncs), rel=1e-12)
    # the comm objective (AutoDDL's) syncs the gradients in the activation type, as before
    assert mlp_problem("comm").cost(a) == pytest.approx(
        sum(BASE.time(Collective.ALLREDUCE, k * n * 2, Group(4)) for k, n in zip(DIMS, DIMS[1:])), rel=1e-12)


def test_plan_records_each_layers_forward_backward_and_optimizer():
    # what autotune execute's layer clock compares: data parallel on 4 GPUs, per micro-batch
    pr = mlp_problem()
    layers = build_plan(pr, data_parallel(pr), "dp").layers
    matmuls = [lay.costs for lay in layers if lay.kind == "matmul"]
    for lay, (k, n) in zip(matmuls, zip(DIMS, DIMS[1:])):
        assert lay["forward_s"] == pytest.approx(mm(T // 4, k, n) + mem(6 * k * n), rel=1e-12)
        assert lay["backward_s"] == pytest.approx(2 * mm(T // 4, k, n) + mem(6 * k * n), rel=1e-12)
        assert lay["optimizer_s"] == pytest.approx(adam(k * n * 28), rel=1e-12)
        assert lay["compute_s"] == pytest.approx(MB * (3 * mm(T // 4, k, n) + 2 * mem(6 * k * n)) + lay["optimizer_s"]
                                                 + (MB - 1) * mem(3 * k * n * 4), rel=1e-12)


def test_megatron_step_splits_the_matmuls():
    # t = 4: fc0 column-parallel (n / 4), fc1 row-parallel (k / 4): a quarter of the flops each, no sync;
    # the all-reduce of the output before the loss is on the critical path (exposed), and its functional
    # form in DTensor clones its input first (a read and a write of the output, compute time)
    pr = mlp_problem()
    a = megatron_assignment(pr, (1, 1), (1, 4))
    t = build_plan(pr, a, "megatron").costs.to_dict()
    fwd = [mm(T, DIMS[0], DIMS[1] // 4), mm(T, DIMS[1] // 4, DIMS[2])]
    casts = sum(2 * mem(6 * k * n // 4) for k, n in zip(DIMS, DIMS[1:]))
    logits = T * DIMS[-1]  # redundant over t: the whole logits
    loss = mem(logits * (2 + 9 * 4)) + mem(logits * (3 * 4 + 2))
    opt = sum(adam(k * n // 4 * 28) for k, n in zip(DIMS, DIMS[1:]))
    accumulate = (MB - 1) * sum(mem(3 * k * n // 4 * 4) for k, n in zip(DIMS, DIMS[1:]))
    clone = copy(2 * logits * 2)
    assert t["compute_s"] == pytest.approx(MB * (sum(3 * f for f in fwd) + casts + loss + clone) + opt + accumulate,
                                           rel=1e-12)
    assert t["exposed_comm_s"] == pytest.approx(t["redistribution_s"], rel=1e-12) and t["grad_sync_s"] == 0


@pytest.mark.parametrize("slowdown", [1.0, 1.4])
def test_local_costs_are_exact_cost_differences_under_the_step_objective(slowdown):
    # with compute slowed beside the hidden sync (the profile's overlap figure) too: the pair search once left
    # that term out, so its moves and the single-layer ones undid each other until the time budget ran out
    cm = dataclasses.replace(CM, overlap={c: slowdown for c in ("all_reduce", "all_gather", "reduce_scatter")})
    pr = mlp_problem(profile=dataclasses.replace(BASE, compute=cm))
    assert pr.sync_slowdown == slowdown
    rng = np.random.default_rng(0)
    for _ in range(30):
        a = [int(rng.integers(n)) for n in pr.sizes]
        v = int(rng.integers(len(a)))
        loc = pr.local(a, v)
        for i in rng.integers(pr.sizes[v], size=5):
            b = list(a)
            b[v] = int(i)
            x, y = pr.raw_cost(b), pr.raw_cost(a)
            if math.isfinite(x) and math.isfinite(y):
                assert loc[i] - loc[a[v]] == pytest.approx(x - y, rel=1e-9, abs=1e-15)
        u, w = sorted(rng.choice(len(a), 2, replace=False))
        if (u, w) in pr.pairs:
            pl = pr.pair_local(a, u, w)
            b = list(a)
            b[u], b[w] = int(rng.integers(pr.sizes[u])), int(rng.integers(pr.sizes[w]))
            assert pl[b[u], b[w]] - pl[a[u], a[w]] == pytest.approx(pr.raw_cost(b) - pr.raw_cost(a), rel=1e-9, abs=1e-15)


def test_search_under_the_step_objective_beats_the_baselines():
    pr = mlp_problem()
    res = make_search("cd").run(pr, Budget(steps=300), np.random.default_rng(0))
    assert res.cost <= min(pr.cost(data_parallel(pr)), pr.cost(megatron_assignment(pr, (1, 1), (1, 4)))) + 1e-15
    with pytest.raises(UserError, match="step objective"):
        make_search("exhaustive").run(pr, Budget(), np.random.default_rng(0))


def test_step_objective_needs_compute_figures(tmp_path, capsys):
    bare = dataclasses.replace(BASE, compute=None)
    g = load_model("mlp", None, {"dims": DIMS, "batch": T, "micro_batch": T})
    with pytest.raises(UserError, match="no compute figures"):
        Problem(g, Coster(bare, Cluster(1, 4)), None, objective="step")
    f = tmp_path / "p.json"
    bare.save(f)
    small = ["--model", "mlp", "--dims", "64,32,16", "--batch", "16", "--micro-batch", "16", "--nodes", "1",
             "--gpus-per-node", "4", "--profile", str(f), "--budget", "0.2", "--compare", "none"]
    assert autotune_main(small + ["--out", str(tmp_path / "o1")]) == 0
    assert "has no compute figures: minimising communication" in capsys.readouterr().out
    assert autotune_main(small + ["--objective", "step", "--out", str(tmp_path / "o2")]) == 2
    assert "no compute figures" in capsys.readouterr().err.strip().splitlines()[-1]


def test_attention_adds_the_measured_layer_around_its_core():
    # GPT on 1 device: the attention layer is its core (scores band) plus the measured work around it
    # (elements band) when the profile has it, else ATTENTION_COPY_PASSES at the copy bandwidth
    from autotune.sbp.steptime import ATTENTION_COPY_PASSES, layer_seconds

    cfg = dict(layers=1, hidden=64, heads=4, sequence=32, vocabulary=128, batch=8, micro_batch=4)
    b, h, s, d = 4, 4, 32, 16
    core = Band(1e15, ((1.0, 1e-6), (1e9, 1e-3)), "scores")
    copies = Band(1e15, ((1.0, 1e-7), (1e9, 1e-4)), "elements")
    plain = ComputeModel("t", "measured", LAUNCH, BW, matmul={"2": Band(PEAK)}, attention={"2": core},
                         attention_backward={"2": core})
    full = dataclasses.replace(plain, attention_copies={"2": copies}, attention_copies_backward={"2": copies})
    for cm in (plain, full):
        pr = Problem(load_model("gpt", None, cfg), Coster(dataclasses.replace(BASE, compute=cm), Cluster(1, 1)),
                     None, objective="step")
        v = next(i for i, op in enumerate(pr.ops) if op.layer.kind == "attention")
        f, bwd = layer_seconds(pr.ops[v], pr.choices[v][0], pr.cluster, cm, 2)
        t_core = core.seconds(b * h * s * s, LAUNCH)
        if cm is full:
            assert (f, bwd) == pytest.approx((t_core + copies.seconds(b * s * h * d, LAUNCH),) * 2, rel=1e-12)
        else:
            out = b * s * h * d
            assert (f, bwd) == pytest.approx((t_core + LAUNCH + ATTENTION_COPY_PASSES[0] * out * 2 / BW,
                                              t_core + LAUNCH + ATTENTION_COPY_PASSES[1] * out * 2 / BW), rel=1e-12)
