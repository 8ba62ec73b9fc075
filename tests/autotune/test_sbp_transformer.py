"""The planner's side of the transformer family (issue 26): cost rules of the new layer kinds against
closed forms, the precision recipe, recomputation and FSDP accounting, the residual stream's cycles in
the dynamic program against brute force, and the baselines users pick.

The graph is the shared contract's, built by models/transformer.py (``contract_graph``)."""
import dataclasses

import numpy as np
import pytest

from calibrate.collectives import Collective
from calibrate.compute import Band, ComputeModel
from calibrate.errors import OptionError
from calibrate.profile import Group, Profile
from models import load_model
from models.graph import Layer, LayerGraph
from autotune.sbp.baselines import baseline_plans, data_parallel, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.dp import LayerDP
from autotune.sbp.fit import search_fitting, search_modes
from autotune.sbp.layers import make_op
from autotune.sbp.memory import MATMUL_SIGNATURES as MATMULS, Mode, kept_bytes, peak_workspace, strategy_memory
from autotune.sbp.mesh import Cluster
from autotune.plan.build import build as build_plan
from autotune.plan.file import PlanFile
from autotune.pipeline.slicing import with_micro_batches
from autotune.sbp.search import Budget, make_search
from calibrate.compute import SDPA_BACKWARD_FACTOR as SDPA_BACKWARD
from autotune.sbp.steptime import fsdp_seconds, layer_seconds

BASE = Profile.load("gcp-a100")
PEAK, LAUNCH, BW = 1e14, 1e-6, 1e12
EW_BW, ADAM_BW = BW / 2, BW / 4
CM = ComputeModel("test: peak-rate model", "assumed", LAUNCH, BW, matmul={"2": Band(PEAK), "4": Band(PEAK)},
                  attention={"2": Band(PEAK)}, op_Bps={"elementwise": EW_BW, "optimizer": ADAM_BW})
PROFILE = dataclasses.replace(BASE, compute=CM)


def contract_graph(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, sequence=8, vocabulary=128, batch=8,
                   micro_batch=4, act_bytes=2, tied=False, flash=1, rotary=1, norm="rmsnorm", mlp="swiglu",
                   positions=0, bias=0) -> LayerGraph:
    """models' builder (the contract's chain: embedding, blocks of (ln1, qkv, attention, proj, residual, ln2,
    fc1, swiglu|gelu, fc2, residual), ln_f, logits, loss; the embedding feeds the first residual through a
    skip edge) on a small Llama-family config."""
    pos = "learned" if positions else "rotary" if rotary else "none"
    return load_model("llama", None, dict(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, sequence=sequence,
        vocabulary=vocabulary, batch=batch, micro_batch=micro_batch, act_bytes=act_bytes, tied=tied,
        attention="flash" if flash else "naive", norm=norm, mlp=mlp, positions=pos, bias=bool(bias),
        qkv_bias=bool(bias), **({"max_positions": positions} if positions else {})))


def _L(name, kind, **dims):
    return Layer(name, kind, tuple(sorted(dims.items())))


def problem(graph, cluster=Cluster(1, 4), limit=None, objective="step", mode=Mode(), profile=PROFILE):
    return Problem(graph, Coster(profile, cluster), limit, objective=objective, mode=mode, require_fit=False)


def strat(pr, name, signature=None, mesh=None):
    v = [lay.name for lay in pr.graph.layers].index(name)
    for i, s in enumerate(pr.choices[v]):
        if (signature is None or s.signature == signature) and (mesh is None or s.mesh.sizes == mesh):
            return v, i, s
    raise LookupError((name, signature, mesh))


def ew(nbytes):
    return LAUNCH + nbytes / EW_BW


# ---------------------------------------------------------------- cost rules of the new kinds

def test_rmsnorm_is_layernorm_without_shift_and_with_one_statistic():
    g = contract_graph()
    pr = problem(g, Cluster(1, 4))
    t, h = 32, 64
    _, _, s = strat(pr, "ln1", "rmsnorm", ((1, 4), (1, 1)))
    assert s.weights[0].shape == (1, h)
    _, _, sp = strat(pr, "ln1", "rmsnorm-split")
    assert sp.weights[0].shape == (1, h) and all(it.shape == (t, 1) for it in sp.internal)
    ln = make_op(_L("ln", "layernorm", tokens=t, hidden=h, bias=0), 2).strategies(Cluster(1, 4))
    assert ln[0].weights[0].shape == (1, h)
    full = make_op(_L("ln", "layernorm", tokens=t, hidden=h), 2).strategies(Cluster(1, 4))
    assert full[0].weights[0].shape == (2, h)  # absent bias: the AutoDDL graph's layer norm, as before
    # compute: the layer norm's passes (2 forward, 5 backward over the local input)
    f, b = layer_seconds(pr.ops[1], s, pr.cluster, CM, 2)
    assert (f, b) == (pytest.approx(ew(2 * t // 4 * h * 2)), pytest.approx(ew(5 * t // 4 * h * 2)))


def test_swiglu_keeps_pairs_halves_features_and_costs_its_passes():
    g = contract_graph()
    pr = problem(g, Cluster(1, 4))
    op = pr.ops[8]
    assert op.in_shape == (32, 256) and op.out_shape == (32, 128)
    _, _, s = strat(pr, "swiglu", "swiglu", ((1, 1), (1, 4)))
    assert s.fine_in == ("S1", "S1") and s.fine_out == ("S1", "S1")
    out = 32 * 128 // 4
    f, b = layer_seconds(op, s, pr.cluster, CM, 2)
    assert f == pytest.approx(ew(5 * out * 2)) and b == pytest.approx(ew(9 * out * 2))
    assert kept_bytes(s, pr.cluster, 2) == 3 * out * 2  # gate, silu(gate) and up in bf16 (memory.user_kept)
    # an ffn that 4 does not divide has no feature split over 4 (the output's S1 checks the pairs)
    odd = make_op(_L("act", "swiglu", tokens=32, hidden=6), 2).strategies(Cluster(1, 4))
    assert all(s.mesh.role_size(1) in (1, 2) for s in odd)


def test_residual_keeps_nothing_and_costs_three_passes_each_way():
    g = contract_graph()
    pr = problem(g, Cluster(1, 4))
    v, _, s = strat(pr, "residual", "residual", ((1, 4), (1, 1)))
    assert kept_bytes(s, pr.cluster, 2) == 0 and pr.counts[v] == 4
    e = 32 // 4 * 64
    assert layer_seconds(pr.ops[v], s, pr.cluster, CM, 2) == (pytest.approx(ew(3 * e * 2)), pytest.approx(ew(3 * e * 2)))


def test_matmul_bias_is_placed_as_the_output_features_and_synced_like_the_weight():
    g = contract_graph(bias=1)
    pr = problem(g, Cluster(1, 4), objective="comm")
    v, _, col = strat(pr, "proj", "autoddl", ((1, 1), (1, 4), (1, 1)))  # role n: output S1
    bias = next(w for w in col.weights if w.name == "bias")
    assert bias.shape == (64,) and bias.sbp == (B_, "S0", B_)
    _, _, dp = strat(pr, "proj", "autoddl", ((1, 4), (1, 1), (1, 1)))  # role m: tokens split
    from autotune.sbp.cost import sync_steps
    names = {n: st for n, st in sync_steps(dp, pr.cluster, 2)}
    assert names["bias"].nbytes == 64 * 2 and names["weight"].nbytes == 64 * 64 * 2
    _, _, row = strat(pr, "proj", "autoddl", ((1, 1), (1, 1), (1, 4)))  # role k: output partial
    assert "bias" not in {n for n, _ in sync_steps(row, pr.cluster, 2)}  # each device holds the whole sum
    m = strategy_memory(col, pr.cluster, 2)
    assert m.parameters == 4 * (64 * 64 + 64) // 4


B_ = "B"


def test_learned_positions_split_like_the_token_table():
    g = contract_graph(positions=8)
    pr = problem(g, Cluster(1, 4))
    _, _, s = strat(pr, "embedding", "autoddl", ((1, 1), (1, 4), (1, 1)))  # table (V, n) split on n
    pos = next(w for w in s.weights if w.name == "positions")
    assert pos.shape == (8, 64) and pos.sbp == (B_, "S1", B_)
    _, _, m = strat(pr, "embedding", "autoddl", ((1, 4), (1, 1), (1, 1)))
    pos = next(w for w in m.weights if w.name == "positions")
    from autotune.sbp.sbp import NdSbp
    assert NdSbp(pos.sbp, m.mesh).fine(pr.cluster) == (B_, B_)  # tokens split: the table replicated
    from autotune.sbp.cost import sync_steps
    assert {n for n, _ in sync_steps(m, pr.cluster, 2)} == {"weight", "positions"}


def test_gqa_flash_attention_keeps_q_k_v_o_and_lse_and_costs_sdpa():
    g = contract_graph(heads=4, kv_heads=2)
    pr = problem(g, Cluster(1, 4))
    v = 3
    op = pr.ops[v]
    assert op.in_shape == (32, (4 + 2 * 2) * 16)
    # S1 must divide the KV heads (2): no split of the heads over 4
    assert all(s.mesh.role_size(1) in (1, 2) for s in pr.choices[v])
    s = next(s for s in pr.choices[v] if s.mesh.sizes == ((1, 2), (1, 2)))
    t, h = 32 // 2, 64 // 2
    assert kept_bytes(s, pr.cluster, 2) == (t * 128 // 2 + t * h) * 2 + t * 2 * 4  # QKV, O, fp32 LSE
    f, b = layer_seconds(op, s, pr.cluster, CM, 2)
    flops = 2 * 2 * 2 * 8 * 8 * 16  # 2 b h s^2 d at the matmul rate (no SDPA figures), backward 2.5x
    core, core_b = LAUNCH + flops / PEAK, LAUNCH + SDPA_BACKWARD * flops / PEAK
    rot = ew(7 * t * (2 + 1) * 16 * 2)  # Q's and K's local elements (heads/S1 + kv_heads/S1)
    copies = (LAUNCH + 8 * t * h * 2 / BW, LAUNCH + 35 * t * h * 2 / BW)
    assert f == pytest.approx(core + rot + copies[0]) and b == pytest.approx(core_b + rot + copies[1])


def test_flash_attention_core_is_the_profiles_sdpa_figure():
    class WithSdpa(ComputeModel):
        def sdpa_seconds(self, batch, heads, kv_heads, seq, head_dim, act_bytes, backward=False):
            return 1e-3 * (3 if backward else 1) * batch * heads * kv_heads * seq * head_dim

    cm = WithSdpa("t", "assumed", LAUNCH, BW, matmul={"2": Band(PEAK)}, op_Bps={"elementwise": EW_BW})
    g = contract_graph(heads=4, kv_heads=2, rotary=0)
    pr = problem(g, Cluster(1, 4))
    s = next(s for s in pr.choices[3] if s.mesh.sizes == ((1, 2), (1, 2)))
    f, b = layer_seconds(pr.ops[3], s, pr.cluster, cm, 2)
    base_f, base_b = layer_seconds(pr.ops[3], s, pr.cluster, CM, 2)
    flops = 2 * 2 * 2 * 8 * 8 * 16
    core, core_b = LAUNCH + flops / PEAK, LAUNCH + SDPA_BACKWARD * flops / PEAK
    # (micro-batch / S0, heads / S1, kv_heads / S1, sequence, head_dim) = (2, 2, 1, 8, 16)
    assert f - base_f == pytest.approx(1e-3 * 2 * 2 * 1 * 8 * 16 - core)
    assert b - base_b == pytest.approx(3e-3 * 2 * 2 * 1 * 8 * 16 - core_b)


def test_naive_attention_keeps_todays_rule():
    g = contract_graph(flash=0, rotary=0, kv_heads=4)
    pr = problem(g, Cluster(1, 4))
    s = next(s for s in pr.choices[3] if s.mesh.sizes == ((1, 2), (1, 2)))
    probs = 4 // 2 * (4 // 2) * 8 * 8
    assert s.extra_act_elems == probs and s.extra_act_bytes == 0
    assert kept_bytes(s, pr.cluster, 2) == (16 * 192 // 2 + probs) * 2


def test_tied_logits_weight_is_the_embeddings_when_placements_agree():
    g = contract_graph(tied=True)
    pr = problem(g, Cluster(1, 4))
    a = data_parallel(pr)
    lv = 11
    assert pr.tied[lv]
    s = pr.choices[lv][a[lv]]
    m = strategy_memory(s, pr.cluster, 2, tied=True)
    assert m.optimizer == 0 and m.parameters == 4 * 64 * 128
    # data parallel: both replicated, the same placement: one tensor
    full = pr.memory_breakdown(a)
    untied = problem(contract_graph(tied=False), Cluster(1, 4)).memory_breakdown(a)
    assert untied.parameters - full.parameters == 4 * 64 * 128
    assert untied.optimizer - full.optimizer == 8 * 64 * 128
    # the search's per-layer sum counts the copy: an upper bound of the plan's memory
    assert pr.memory_of(a) + full.workspace >= full.total


# ---------------------------------------------------------------- the precision recipe

def test_bf16_autocast_recipe_memory_closed_form():
    g = contract_graph(layers=1, flash=1)
    pr = problem(g, Cluster(1, 1))
    a = data_parallel(pr)
    m = pr.memory_breakdown(a)
    h, V, f, kv = 64, 128, 128, 2
    qkv = h * (4 + 2 * kv) * 16
    mat = qkv + h * h + h * 2 * f + f * h
    params = V * h + 3 * h + mat + h * V  # embedding, 3 RMSNorm scales, the block's matmuls, logits
    assert (m.parameters, m.gradients, m.optimizer) == (4 * params, 4 * params, 8 * params)
    t = 32
    copies = 2 * (mat + h * V)  # autocast's bf16 copies of the matmul weights
    # as a user's autocast step keeps them (memory.user_kept): the RMSNorms their fp32 input and normalised
    # product; qkv one bf16 copy of ln1's output per projection (q, k, v), fc1 per projection (gate, up),
    # logits one; attention Q, K, V, O (bf16) and the LSE (fp32); proj its bf16 input; SwiGLU gate, silu(gate)
    # and up; fc2 its bf16 input; the residual adds nothing; the loss the fp32 log-probabilities
    norms = 3 * 2 * 4 * t * h
    acts = norms + 3 * 2 * t * h + 2 * (t * (qkv // h) + t * h) + t * 4 * 4 + 2 * t * h + 2 * 2 * t * h
    acts += 3 * 2 * t * f + 2 * t * f + 2 * t * h + 4 * t * V
    assert m.activations == acts + copies


def test_a_weight_bound_steps_peak_is_the_optimizer_step_with_no_activation_left():
    """One micro-batch of few tokens and wide layers: the gradients of every weight outweigh whatever a
    backward position holds, so the peak is the optimizer step, where every activation (autocast's bf16
    weight copies among them, each freed with its layer's backward) is gone: parameters + gradients +
    optimizer states exactly (the copies were once left in the total: one H100, a 2-layer 7168-wide Llama,
    predicted 28.92 GiB, measured 26.21)."""
    g = contract_graph(layers=2, hidden=256, heads=4, kv_heads=2, ffn=1024, sequence=4, batch=1, micro_batch=1)
    pr = problem(g, Cluster(1, 1))
    m = pr.memory_breakdown(data_parallel(pr))
    assert m.activations > 0
    assert m.total == pytest.approx(m.parameters + m.gradients + m.optimizer, rel=1e-12)


# ---------------------------------------------------------------- recomputation

def test_full_recompute_keeps_only_block_inputs_and_reruns_the_forward():
    g = contract_graph(layers=2)
    none, full = problem(g), problem(g, mode=Mode("full"))
    a = data_parallel(none)
    t = 32 // 4
    mn, mf = none.memory_breakdown(a), full.memory_breakdown(a)
    outside = sum(kept_bytes(none.choices[v][a[v]], none.cluster, 2) for v in (0, 10, 11, 12))
    assert mf.activations == outside + 2 * (t * 64 * 4) + 2 * 64 * 128  # 2 fp32 block inputs, the logits' bf16 copy
    assert mf.parameters == mn.parameters and mf.activations < mn.activations
    # compute: each block layer's backward gains its forward, but torch's checkpoint stops re-running at the
    # block's last saved tensor: the closing fc2 (layer 9) re-runs its casts, not its product; the residual add
    # (layer 5, in the block and at its tail) counts as re-run
    assert full.roles[9] == "last" and full.roles[5] == "inside" and full.chain_roles[-4] == "tail"
    for v in range(1, 10):
        s = none.choices[v][a[v]]
        f, b = layer_seconds(none.ops[v], s, none.cluster, CM, 2)
        f2, b2 = layer_seconds(none.ops[v], s, none.cluster, CM, 2, "full", full.roles[v])
        product = LAUNCH + 2 * t * 128 * 64 / PEAK if v == 9 else 0.0  # fc2: 8 tokens x 128 -> 64
        assert (f2, b2) == (f, pytest.approx(b + f - product, rel=1e-12))
    assert build_plan(full, a, "x").recompute == "full"
    # forward boxings inside a block run twice: (ln1, qkv) always inside, (residual, ln1) crosses blocks, (fc2,
    # residual) is at the block's tail, not re-run
    ff = full.tables.forward_factor
    assert ff[(1, 2)] == 2.0 and (5, 1) not in ff and ff[(5, 6)] == 2.0 and ff[(8, 9)] == 2.0 and (9, 5) not in ff


@pytest.mark.parametrize("tied", [False, True])
def test_full_recompute_peaks_at_the_forwards_end_with_autocasts_cached_copies_and_the_loss(tied):
    """Under full recomputation autocast's cache keeps the bf16 copy of every block weight it cast until the
    forward ends, after the loss, whose forward then also holds its bf16 input (the logits, which the model's
    output holds) and the fp32 copy it computes on (2 x H200, 2026-11-30: both alive at Llama 3 8B's peak inside
    cross_entropy under FSDP): where that is the peak (one H100, development D2: predicted 9.12 GiB without it, measured 9.98; here
    made the peak by a forward transient, a key/value cache, of 1 GiB) the workspace is exactly those. No gradient
    exists then: a tied logits weight's gradient, which the breakdown counts once, is not taken off that peak a
    second time."""
    t, V, h, ffn = 4 * 64, 4096, 256, 512
    g = contract_graph(layers=2, hidden=h, heads=4, kv_heads=2, ffn=ffn, sequence=64, vocabulary=V, batch=4,
                       micro_batch=4, tied=tied)
    pr = problem(g, Cluster(1, 1), mode=Mode("full"))
    a = data_parallel(pr)
    m = pr.memory_breakdown(a)
    per_block = h * (h + 2 * 2 * (h // 4)) + h * h + h * 2 * ffn + ffn * h  # qkv (2 KV heads), proj, fc1, fc2
    copies = 2 * 2 * per_block  # two blocks, bf16
    loss_forward = (2 + 4) * t * V  # the bf16 logits and their fp32 copy
    chain = [pr.choices[v][a[v]] for v in g.chain]
    grads = sum(strategy_memory(s, pr.cluster, 2, pr.mode, r).gradients for s, r in zip(chain, pr.chain_roles))
    cache = 2 ** 30
    ws = peak_workspace(chain, pr.cluster, 2, 1, pr.mode, pr.chain_roles, pr.recipe, grads - m.gradients, cache)
    assert ws == pytest.approx(copies + loss_forward + cache - m.gradients, rel=1e-12)


def test_selective_recompute_drops_the_probabilities_only_for_naive_attention():
    naive = contract_graph(flash=0, rotary=0, kv_heads=4)
    pr = problem(naive, mode=Mode("selective"))
    s = pr.choices[3][0]
    assert kept_bytes(s, pr.cluster, 2, "selective") == local(s.input, s, pr.cluster) * 2
    f, b = layer_seconds(pr.ops[3], s, pr.cluster, CM, 2)
    f2, b2 = layer_seconds(pr.ops[3], s, pr.cluster, CM, 2, "selective")
    assert b2 > b and f2 == f
    flash = problem(contract_graph(), mode=Mode("selective"))
    s = flash.choices[3][0]
    assert kept_bytes(s, flash.cluster, 2, "selective") == kept_bytes(s, flash.cluster, 2)
    from autotune.sbp.fit import recompute_modes
    assert recompute_modes(flash) == ["full"] and recompute_modes(pr) == ["selective", "full"]


def local(t, s, cluster):
    from autotune.sbp.layers import local_elems
    return local_elems(t, s.mesh, cluster)


# ---------------------------------------------------------------- FSDP

def test_fsdp_divides_weights_and_gathers_them_per_micro_batch():
    g = contract_graph(layers=1, batch=8, micro_batch=4)  # 2 micro-batches
    cl = Cluster(1, 4)
    plain = problem(g, cl, objective="comm")
    fsdp = problem(g, cl, objective="comm", mode=Mode("none", (0, 1)))
    a = data_parallel(plain)
    mp, mf = plain.memory_breakdown(a), fsdp.memory_breakdown(a)
    assert mf.parameters == mp.parameters / 4 and mf.optimizer == mp.optimizer / 4
    # no all-reduce a step; per micro-batch each weight gathered forward and backward, its gradient
    # reduce-scattered (fp32, its whole local bytes)
    assert all(x == 0 for x in fsdp.node_sync[2])
    v = 2  # qkv
    n = 64 * (4 + 4) * 16 * 4
    ag, rs = (BASE.time(c, n, Group(4)) for c in (Collective.ALLGATHER, Collective.REDUCESCATTER))
    assert fsdp.node_redist[v][a[v]] - plain.node_redist[v][a[v]] == pytest.approx(2 * (2 * ag + rs), rel=1e-12)
    # workspace: two layers' gathered weights (fp32, whole: an allocation beside the shards), the two largest
    gathered = sorted(4 * sum(local(w, s, cl) for w in s.weights) for s in
                      (fsdp.choices[u][a[u]] for u in fsdp.graph.chain))
    assert mf.workspace == pytest.approx(mp.workspace + gathered[-1] + gathered[-2])
    plan = build_plan(fsdp, a, "fsdp")
    assert (plan.sharding_mode, plan.sharding_axes) == ("fsdp", (0, 1))
    assert any(c.phase == "fsdp" for lay in plan.layers for c in lay.collectives)


def test_on_the_dtensor_path_autocast_caches_no_copy_of_a_gathered_weight_under_full_recomputation():
    """Under full recomputation the forward's end holds autocast's cached bf16 copy of every re-run block's
    weights: fully_shard's unsharded parameters are leaves, whose casts autocast caches; the DTensor path gathers
    an FSDP-sharded weight at use by a parametrization, whose casts it does not (both shown on the CPU in
    ``test_apply_recompute``). So the DTensor path's peak there is the fully_shard path's less
    the copies of the blocks' sharded weights, down to the backward's peak, which holds no cached copy (with eight
    blocks the forward's end is the fully_shard path's peak); without FSDP the two are the same."""
    g = contract_graph(layers=8, batch=8, micro_batch=4)
    cl = Cluster(1, 4)
    for mode, sharded in ((Mode("full", (0, 1)), True), (Mode("full"), False)):
        pr = problem(g, cl, objective="comm", mode=mode)
        a = data_parallel(pr)
        leaf, gathered = pr.memory_breakdown(a), pr.memory_breakdown(a, cached_gathered=False)
        copies = sum(2 * local(w, s, cl) for p in range(len(pr.graph.chain)) if pr.chain_roles[p] != "outside"
                     for s in (pr.choices[pr.graph.chain[p]][a[pr.graph.chain[p]]],) if s.signature in MATMULS
                     for w in s.weights)
        assert copies > 0
        saved = leaf.workspace - gathered.workspace
        assert (0.25 * copies < saved <= copies * (1 + 1e-12)) if sharded else saved == 0.0

def test_a_built_plan_fits_by_the_peak_of_the_path_it_runs_on():
    """The fit a plan reports is judged on the peak it reports: on the DTensor path without the gathered weights'
    cached casts (above). A limit between the two peaks fits the DTensor path's plan and not fully_shard's (the
    main command on Llama 3 405B printed a TP+FSDP baseline of 69.79 GiB as "no plan fits, -51.63 GiB over")."""
    from autotune.plan.typed import ApplyPath
    g = contract_graph(layers=8, batch=8, micro_batch=4)
    pr = problem(g, Cluster(1, 4), objective="comm", mode=Mode("full", (0, 1)))
    a = data_parallel(pr)
    leaf, gathered = pr.memory_breakdown(a).total, pr.memory_breakdown(a, cached_gathered=False).total
    assert gathered < leaf
    pr.device_limit = (leaf + gathered) / 2
    on_dtensor, on_fully_shard = (build_plan(pr, a, "fsdp", path=p).costs for p in (ApplyPath.DTENSOR,
                                                                                     ApplyPath.FULLY_SHARD))
    assert on_dtensor.memory_bytes == pytest.approx(gathered) and on_dtensor.fits_memory
    assert on_fully_shard.memory_bytes == pytest.approx(leaf) and not on_fully_shard.fits_memory


def test_fsdp_exposed_is_what_the_layers_compute_does_not_cover_and_its_copies():
    g = contract_graph(layers=1)
    pr = problem(g, Cluster(1, 4), mode=Mode("none", (0, 1)))
    a = data_parallel(pr)
    s = pr.choices[2][a[2]]
    ag = pr.coster.step_time(__import__("autotune.sbp.boxing", fromlist=["Step"]).Step("allgather", (0, 1), 64 * 128 * 4))
    rs = pr.coster.step_time(__import__("autotune.sbp.boxing", fromlist=["Step"]).Step("reducescatter", (0, 1), 64 * 128 * 4))
    # fully_shard's copies on the compute stream: out of each of the two all-gathers, into the reduce-scatter, and
    # into each all-gather from the local shard (a quarter of the bytes over the 4 devices)
    cm = pr.coster.profile.compute
    copies = 3 * cm.memory_seconds(2 * 64 * 128 * 4) + 2 * cm.memory_seconds(2 * 64 * 128 * 4 / 4)
    assert copies > 0
    assert fsdp_seconds(s, pr.cluster, pr.coster, pr.mode, 0.0, 0.0) == pytest.approx(2 * ag + rs + copies)
    assert fsdp_seconds(s, pr.cluster, pr.coster, pr.mode, ag / 2, 10.0) == pytest.approx(ag / 2 + copies)
    assert fsdp_seconds(s, pr.cluster, pr.coster, pr.mode, 10.0, 10.0) == pytest.approx(copies)
    assert fsdp_seconds(s, pr.cluster, pr.coster, pr.mode, None, None) == pytest.approx(2 * ag + rs)  # comm objective


# ---------------------------------------------------------------- residual cycles: DP against brute force

def brute(pr):
    n = len(pr.sizes)

    def along(v, x):
        shape = [1] * n
        shape[v] = pr.sizes[v]
        return np.asarray(x, dtype=float).reshape(shape)

    cost = sum(along(v, pr.node[v]) for v in range(n))
    for (a, b), c in pr.edge_counts.items():
        if a == b:
            cost = cost + along(a, c * pr.tables.diagonal(a))
        else:
            shape = [1] * n
            shape[a], shape[b] = pr.sizes[a], pr.sizes[b]
            t = c * pr.edge_matrix(a, b)
            cost = cost + (t if a < b else t.T).reshape(shape)
    return cost


@pytest.mark.parametrize("mode", [Mode(), Mode("full")])
def test_dp_over_the_residual_streams_cycles_is_the_brute_force_optimum(mode):
    g = contract_graph(layers=2, heads=2, kv_heads=2, hidden=32, ffn=32, vocabulary=64)
    pr = problem(g, Cluster(1, 2), objective="comm", mode=mode)
    assert (0, 5) in pr.edge_counts and (5, 1) in pr.edge_counts and (5, 6) in pr.edge_counts
    cost = brute(pr)
    value, plan = LayerDP(pr).solve(list(pr.node))
    assert value == pytest.approx(cost.min(), rel=1e-12)
    assert pr.raw_cost(plan) == pytest.approx(cost.min(), rel=1e-12)
    # and the local search finds it too
    res = make_search("cd").run(pr, Budget(patience=5), np.random.default_rng(0))
    assert res.cost == pytest.approx(cost.min(), rel=1e-9)


# ---------------------------------------------------------------- fit check and modes

def test_search_fitting_reserves_the_workspace():
    g = contract_graph(layers=2)
    free = problem(g, Cluster(1, 4))
    best = make_search("cd").run(free, Budget(patience=3), np.random.default_rng(0)).assignment
    m = free.memory_breakdown(best)
    limit = m.total - m.workspace / 2  # the per-layer sum fits, the peak does not
    pr = problem(g, Cluster(1, 4), limit)
    assert pr.feasible(best) and not pr.fits_plan(best)

    def run(p, start):
        return make_search("cd").run(p, Budget(patience=3), np.random.default_rng(0), start)
    res = search_fitting(pr, run)
    assert pr.fits_plan(res.assignment) and pr.peak_memory(res.assignment) <= limit
    assert pr.reserve > 0


def test_modes_search_picks_a_mode_that_fits_where_the_plain_one_cannot():
    g = contract_graph(layers=2)
    plain = problem(g, Cluster(1, 4))
    full = plain.with_mode(Mode("full", (0, 1)))
    limit = full.peak_memory(full.min_memory_assignment()) * 1.01  # the least-memory plan fully recomputed and
    assert limit < plain.min_memory  # sharded fits; no plain plan does
    pr = problem(g, Cluster(1, 4), limit, mode=Mode())
    pr_none = pr.fits

    def run(p, start, share=1.0):
        return make_search("cd").run(p, Budget(patience=2), np.random.default_rng(0), start)
    got, res = search_modes(pr, run)
    assert not pr_none and res is not None and got.fits_plan(res.assignment)
    assert got.mode.recompute != "none" or got.mode.fsdp_axes is not None


def test_modes_cover_fsdp_over_every_axis_the_intra_node_and_the_node_axes():
    from autotune.sbp.fit import sharding_modes
    pr = problem(contract_graph(), Cluster(2, 4))  # fine axes: node 2, GPUs 2 x 2
    assert sharding_modes(pr) == [None, (0, 1, 2), (1, 2), (0,)]
    assert sharding_modes(problem(contract_graph(), Cluster(1, 4))) == [None, (0, 1)]


def test_baselines_users_pick_are_present_each_with_its_row():
    g = contract_graph(layers=2)
    pr = problem(g, Cluster(2, 2), 1.0)  # 1 byte: nothing fits, every row kept with the memory it needs
    plans = [build_plan(*b) for b in baseline_plans(pr, None, None, None)]
    names = [p.strategy for p in plans]
    for want in ("data parallel", "Megatron", "FSDP", "HSDP", "TP+FSDP"):
        assert any(n.startswith(want) for n in names), names
    for p in plans:
        assert not p.costs.fits_memory and p.costs.memory_bytes > 1
        assert p.recompute in ("none", "selective", "full") and p.sharding_mode in ("none", "fsdp")
    fs = next(p for p in plans if p.strategy.startswith("FSDP"))
    assert (fs.sharding_mode, fs.sharding_axes) == ("fsdp", (0, 1))
    hs = next(p for p in plans if p.strategy.startswith("HSDP"))
    assert (hs.sharding_mode, hs.sharding_axes) == ("fsdp", (1,))
    tp = next(p for p in plans if p.strategy.startswith("TP+FSDP"))
    assert (tp.sharding_mode, tp.sharding_axes) == ("fsdp", (0,))
    # with room, the baselines fit and each is at its cheapest recomputation (none: nothing to save)
    roomy = [build_plan(*b) for b in baseline_plans(problem(g, Cluster(2, 2), 2.0**40), None, None, None)]
    assert all(p.costs.fits_memory and p.recompute == "none" for p in roomy)


def test_the_command_never_returns_a_plan_slower_than_a_fitting_baseline():
    from autotune.planner import floor
    from dataclasses import replace

    from autotune.plan.typed import Costs
    g = contract_graph(layers=2)
    pr = problem(g, Cluster(2, 2), 2.0**40)
    base = build_plan(pr, data_parallel(pr), "x")

    def plan(strategy, step, fits=True):
        return replace(base, strategy=strategy, costs=Costs(0.0, 0.0, 0.0, 1.0, fits, step_s=step), search={})
    hsdp = plan("HSDP (sharded inside each node)", 1.5)
    unfit = plan("FSDP", 1.0, False)
    summa = plan("SUMMA 2D", 0.5)  # another problem's plan
    got = floor(plan("searched (cd)", 2.0), [hsdp, unfit, summa], "step")
    assert got.costs.step_s == 1.5 and got.search["replaced_by"] == hsdp.strategy
    assert floor(plan("searched (cd)", 1.0), [hsdp], "step").strategy == "searched (cd)"


def test_the_accumulation_count_is_searched_where_it_is_left_open():
    """A micro-batch left open: the counts of 1, 2, 4, 8 sequences a device that divide the batch; the searched plan
    and each baseline kind (at its best recomputation) at the fastest count that fits, named with its count, the
    same plan as the search at that count alone."""
    from autotune.planner import _at_counts, accumulation_choices, search
    g = contract_graph(layers=2, batch=32, micro_batch=2)
    assert accumulation_choices(g, 2) == (16, 8, 4, 2) and accumulation_choices(g, 8) == (4, 2, 1)
    assert accumulation_choices(contract_graph(batch=12, micro_batch=2), 2) == (6, 3)
    opts = dict(memory_limit=None, objective="step", budget=Budget(seconds=0.2), pipeline="off", compare=())
    prof = Profile.load("h200-nvlink")  # host and overlap figures: step-time planning of 2 devices
    both = search(g, Cluster(1, 2), prof, micro_batches=(16, 4), **opts)
    alone = {c: search(with_micro_batches(g, c), Cluster(1, 2), prof, **opts) for c in (16, 4)}
    fastest = min(alone.values(), key=lambda pf: pf.best.costs.step_s)
    assert both.best.costs.step_s == pytest.approx(fastest.best.costs.step_s)
    assert both.best.micro_batches == fastest.best.micro_batches
    dp = [b for b in both.baselines if b.strategy.startswith("data parallel")]
    assert len(dp) == 1 and dp[0].costs.step_s == pytest.approx(min(
        b.costs.step_s for pf in alone.values() for b in pf.baselines if b.strategy.startswith("data parallel")))
    # one kind whatever its recomputation: the faster of the two counts, named with its count where it is not 16
    base = build_plan(problem(g, Cluster(1, 2)), data_parallel(problem(g, Cluster(1, 2))), "data parallel")
    slow = dataclasses.replace(base, costs=dataclasses.replace(base.costs, step_s=2.0))
    fast = dataclasses.replace(base, strategy="data parallel, recompute full", recompute="full", micro_batches=4,
                               costs=dataclasses.replace(base.costs, step_s=1.0))
    _, kinds = _at_counts(slow, [slow], [PlanFile(fast, [fast], {}, {})], "step")
    assert [k.strategy for k in kinds] == ["data parallel, recompute full, 4 micro-batches"]
    # a baseline at another count cheaper than the search's plan at every count: the floor returns it
    searched = dataclasses.replace(slow, strategy="searched (cd)")
    plan, _ = _at_counts(searched, [slow], [PlanFile(dataclasses.replace(searched, micro_batches=4), [fast], {}, {})],
                         "step")
    assert plan.costs.step_s == 1.0 and plan.search["replaced_by"] == kinds[0].strategy


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_megatron_runs_the_mlp_column_then_row_parallel(mlp):
    # Megatron's MLP: fc1 column-parallel, the activation (GELU, or SwiGLU on fc1's interleaved gate and up)
    # on the features fc1 split over t, fc2 row-parallel: no boxing between fc1 and fc2, and per block and
    # micro-batch the forward's two all-reduces (after proj and fc2) and the backward's two (before qkv and fc1),
    # so one more block adds exactly 4 all-reduces of the (tokens / d) x hidden activation over t.
    t, tokens, hidden = 4, 4 * 8, 64
    costs = []
    for layers in (1, 2):
        pr = problem(contract_graph(layers=layers, mlp=mlp, kv_heads=4), Cluster(1, 4), objective="comm")
        a = megatron_assignment(pr, (1, 1), (1, t))
        chosen = {pr.ops[v].layer.name: pr.choices[v][a[v]] for v in pr.graph.chain}
        # row-parallel: each device's rows of the weight, the output partial sums over t
        assert chosen["fc2"].uses_partial and not chosen["fc1"].uses_partial, (chosen["fc1"], chosen["fc2"])
        costs.append(pr.cost(a))
    ar = PROFILE.time(Collective.ALLREDUCE, tokens * hidden * 2, Group(t))
    assert costs[1] - costs[0] == pytest.approx(pr.mb * 4 * ar, rel=1e-9)


def test_a_strategy_hashes_once_and_as_its_fields():
    """Strategies key the searches' memoised figures: the hash is made once per object (``mesh.cached_hash``),
    equal strategies hash alike, another field another hash, and a copy made by pickling computes its own."""
    import pickle
    g = contract_graph()
    cl = Cluster(1, 4)
    s = next(st for layer in g.layers for st in make_op(layer, 2).strategies(cl) if st.weights)
    twin = dataclasses.replace(s)
    assert twin is not s and twin == s and hash(twin) == hash(s) and s.__dict__["_hash"] == hash(s)
    other = dataclasses.replace(s, extra_act_elems=s.extra_act_elems + 1)
    assert other != s and hash(other) != hash(s)
    back = pickle.loads(pickle.dumps(s))
    assert "_hash" not in back.__dict__ and back == s and hash(back) == hash(s)


def test_the_default_allocator_keeps_room_for_the_losss_fp32_logits():
    """Single-stage plans keep the step's largest allocation free under the usable memory (the loss's fp32 copy of
    a device's logits: 4 bytes x its sequences x sequence x vocabulary; three plans priced under their limit ran out
    asking for it on 2 x H200), not under expandable segments, and never above the limit given."""
    from autotune.planner import headroom_limit
    from autotune.sbp.memory import largest_block
    p = Profile.load("h200-nvlink")
    g = load_model("llama", None, {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128,
                                   "vocabulary": 128256, "sequence": 4096, "batch": 64, "micro_batch": 16})
    block = 4 * (16 // 2) * 4096 * 128256
    assert largest_block(g, 2) == block and largest_block(g, 64) == 4 * 4096 * 128256  # at least one sequence
    usable = p.device.usable_bytes
    assert headroom_limit(usable, p, g, Cluster(1, 2)) == usable - block
    assert headroom_limit(usable, p, g, Cluster(1, 2), "expandable_segments") == usable
    assert headroom_limit(10 * 2**30, p, g, Cluster(1, 2)) == 10 * 2**30
    assert headroom_limit(None, p, g, Cluster(1, 2)) is None
    huge = load_model("llama", None, {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128,
                                      "vocabulary": 128256, "sequence": 4096, "batch": 128, "micro_batch": 128})
    assert largest_block(huge, 1) > usable  # 128 x 4096 x 128256 x 4 bytes: 250.5 GiB
    with pytest.raises(OptionError, match=r"micro_batch 128 on 1 device.*250.5 GiB, more than the device's usable"):
        headroom_limit(usable, p, huge, Cluster(1, 1))
    assert headroom_limit(usable, p, huge, Cluster(1, 2)) == usable - largest_block(huge, 2)
