"""The precision recipes (``autotune.sbp.memory.RECIPES``) against closed forms: Megatron-LM's fp16 and bf16
recipes (20 and 18 bytes a parameter, 4 + 16/d and 6 + 12/d with the distributed optimizer: the Megatron Core
guide's table), every edge and the gradient sync in the recipe's types, no autocast casts or copies, and the
published cases declaring theirs."""
import math

import pytest

from calibrate.errors import UserError
from autotune.published import load_cases, recipe
from autotune.sbp.baselines import data_parallel
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Catalogue, Problem, sync_steps
from autotune.sbp.memory import RECIPES, Mode, kept_bytes, precision, recipe_of
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import LOSS_PARALLEL_BYTES, layer_seconds, optimizer_seconds

from test_sbp_transformer import CM, LAUNCH, PEAK, PROFILE, contract_graph, ew

ADAM_BW = 1e12 / 4


def problem(recipe, cluster=Cluster(1, 1), mode=Mode(), **graph):
    return Problem(contract_graph(**graph), Coster(PROFILE, cluster), None, objective="step", mode=mode,
                   recipe=recipe, require_fit=False)


def params(h=64, V=128, f=128, kv=2):
    qkv = h * (4 + 2 * kv) * 16
    mat = qkv + h * h + h * 2 * f + f * h
    return V * h + 3 * h + mat + h * V  # embedding, 3 RMSNorm scales, the block's matmuls, logits


@pytest.mark.parametrize("name, per_parameter, sharded", [
    ("autocast", (4, 4, 8), 8), ("autoddl", (2, 2, 12), 12),
    ("megatron-fp16", (2, 2, 16), 16), ("megatron-bf16", (2, 4, 12), 12)])
def test_bytes_a_parameter_and_the_distributed_optimizers_share(name, per_parameter, sharded):
    assert precision(2, name) == per_parameter and precision(4, name) == (4, 4, 8)
    d = 4
    one = problem(name, layers=1).memory_breakdown(data_parallel(problem(name, layers=1)))
    assert (one.parameters, one.gradients, one.optimizer) == tuple(b * params() for b in per_parameter)
    # Megatron's distributed optimizer (ZeRO-1) on d data-parallel ranks: w + g + optimizer / d bytes a parameter
    pr = problem(name, Cluster(1, d), Mode(zero=1), layers=1)
    m = pr.memory_breakdown(data_parallel(pr))
    w, g, _ = per_parameter
    assert (m.parameters, m.gradients, m.optimizer) == (w * params(), g * params(), sharded * params() / d)
    if name.startswith("megatron"):  # the guide's 20 / 18 and 4 + 16/d / 6 + 12/d
        assert sum(per_parameter) == {"megatron-fp16": 20, "megatron-bf16": 18}[name]
        assert (m.parameters + m.gradients + m.optimizer) / params() == w + g + sharded / d


@pytest.mark.parametrize("name", ["megatron-fp16", "megatron-bf16"])
def test_megatron_keeps_every_activation_in_half_precision_and_no_autocast_copy(name):
    pr = problem(name, layers=1)
    m = pr.memory_breakdown(data_parallel(pr))
    t, h, f, V, heads = 32, 64, 128, 128, 4
    # the norms', qkv's, proj's, fc1's and logits' inputs (t h, 2 bytes: no fp32 stream, one copy for the fused
    # QKV); attention Q, K, V (t x 128), O and the fp32 log-sum-exp; SwiGLU its input (t x 2f); fc2 its input;
    # the vocab-parallel loss its fp32 softmax (Megatron casts the logits to fp32)
    acts = 7 * 2 * t * h + (2 * t * 128 + 2 * t * h + 4 * t * heads) + 2 * t * 2 * f + 2 * t * f + 4 * t * V
    assert m.activations == acts
    autocast = problem("autocast", layers=1)
    assert autocast.memory_breakdown(data_parallel(autocast)).activations > acts  # the fp32 stream and the copies


def test_every_edge_and_the_gradient_sync_in_the_recipes_types():
    auto = problem("autocast", Cluster(1, 4))
    fp16, bf16 = problem("megatron-fp16", Cluster(1, 4)), problem("megatron-bf16", Cluster(1, 4))
    edges = list(auto.edge_counts)
    assert {fp16.tables.sizes(a, b) for a, b in edges} == {bf16.tables.sizes(a, b) for a, b in edges} == {(2, 2)}
    assert (4, 4) in {auto.tables.sizes(a, b) for a, b in edges}  # the users' fp32 stream
    # the data-parallel gradient all-reduce: fp16 main gradients in fp16, bf16's fp32 main gradients in fp32
    assert (fp16.grad_bytes, bf16.grad_bytes, auto.grad_bytes) == (2, 4, 4)
    a = data_parallel(fp16)
    v = fp16.graph.chain[1]  # ln1: one weight of h elements, all-reduced over the 4 devices
    for pr, nbytes in ((fp16, 64 * 2), (bf16, 64 * 4)):
        (_, step), = sync_steps(pr.choices[v][a[v]], pr.cluster, pr.grad_bytes)
        assert step.op == "allreduce" and step.nbytes == nbytes and math.prod(
            pr.cluster.axis_sizes[x] for x in step.axes) == 4
        assert pr.node_sync[v][a[v]] == pr.coster.step_time(step)


@pytest.mark.parametrize("name, g", [("megatron-fp16", 2), ("megatron-bf16", 4)])
def test_no_weight_cast_the_main_gradients_add_and_the_optimizers_copies(name, g):
    pr = problem(name)
    a = data_parallel(pr)
    v = pr.graph.chain[2]  # qkv: 32 tokens x 64 -> 128 on one device
    s = pr.choices[v][a[v]]
    n = 64 * 128
    f, b = layer_seconds(pr.ops[v], s, pr.cluster, CM, 2)
    product = LAUNCH + 2 * 32 * 64 * 128 / PEAK
    # forward: the product alone; backward: two products and the half gradient added into the main one
    assert (f, b) == (pytest.approx(product, rel=1e-12), pytest.approx(2 * product + ew((2 + 2 * g) * n), rel=1e-12))
    copies = ew(6 * n) if g == 4 else ew(12 * n)  # master -> half weight; fp16: also the main gradient up to fp32
    assert optimizer_seconds(s, pr.cluster, CM, 2) == pytest.approx(LAUNCH + 28 * n / ADAM_BW + copies, rel=1e-12)


def test_published_cases_declare_their_recipe_and_a_missing_one_is_one_line():
    got = {c["id"]: recipe(c) for c in load_cases()}
    assert {v for k, v in got.items() if k.startswith("megatron")} == {"megatron-fp16"}
    assert {v for k, v in got.items() if k.startswith("llama3")} == {"megatron-bf16"}
    with pytest.raises(UserError, match="recipe 'fp8'"):
        recipe({"id": "x", "recipe": "fp8", "recipe_source": "s"})
    with pytest.raises(UserError, match="unknown recipe"):
        recipe_of("fp8")
    coster = Coster(PROFILE, Cluster(1, 1))
    with pytest.raises(UserError, match="catalogue's own"):
        Problem(contract_graph(), coster, None, recipe="autocast", catalogue=Catalogue(coster, "megatron-bf16"))
    assert Problem(contract_graph(), coster, None, catalogue=Catalogue(coster, "megatron-bf16")).recipe == "megatron-bf16"
    assert set(RECIPES) == {"autocast", "autoddl", "megatron-fp16", "megatron-bf16"}


@pytest.mark.parametrize("name, extra", [("autocast", LOSS_PARALLEL_BYTES), ("megatron-bf16", (0, 0))])
def test_the_loss_on_logits_split_by_vocabulary_as_torchs_loss_parallel_costs_its_passes(name, extra):
    """Under autocast the loss on split logits runs as torch's ``loss_parallel``, its log-softmax in separate passes:
    the fused loss on as many local logits (the logits split by tokens) plus ``LOSS_PARALLEL_BYTES`` (measured) a
    local logit at the elementwise bandwidth; Megatron's own vocabulary-parallel loss (its recipes) is priced as the
    fused one. 2 x H200: a per-layer plan with the head split by vocabulary ran 157 ms a step over its prediction
    before."""
    pr = problem(name, cluster=Cluster(1, 2), layers=1)
    v = next(v for v, op in enumerate(pr.ops) if op.layer.kind == "loss")
    split = next(s for s in pr.choices[v] if s.signature == "loss" and s.mesh.role_size(1) == 2)
    by_tokens = next(s for s in pr.choices[v] if s.signature == "loss" and s.mesh.role_size(1) == 1)
    got, fused = (layer_seconds(pr.ops[v], s, pr.cluster, CM, 2) for s in (split, by_tokens))
    local = 32 * 128 // 2  # tokens x vocabulary, a half each
    assert got == pytest.approx(tuple(f + (CM.op_seconds("elementwise", local * n) if n else 0.0)
                                      for f, n in zip(fused, extra)), rel=1e-12)


@pytest.mark.parametrize("name, split_kept, split_work", [("autocast", 4, 12), ("megatron-bf16", 4, 2)])
def test_the_loss_on_logits_split_by_vocabulary_as_torchs_loss_parallel_holds_it(name, split_kept, split_work):
    """Under autocast the loss on split logits runs as torch's ``loss_parallel`` (apply's, in the step users run: a
    transformers model's loss on its fp32 copy of the logits): 4 bytes a local logit kept, 12 while its backward runs; F.cross_entropy on whole logits 4 and 8; Megatron's own vocab-parallel loss
    (its recipes) keeps its fp32 softmax and works in place (the half gradient)."""
    from autotune.sbp.memory import work_bytes
    pr = problem(name, cluster=Cluster(1, 2), layers=1)
    loss = next(v for v, op in enumerate(pr.ops) if op.layer.kind == "loss")
    split = next(s for s in pr.choices[loss] if s.signature == "loss" and s.mesh.role_size(1) == 2)
    whole = next(s for s in pr.choices[loss] if s.signature == "loss" and s.mesh.role_size(1) == 1)
    cl = pr.cluster
    local = 32 * 128 // 2  # tokens x vocabulary, a half each (split by vocabulary, or by tokens)
    assert kept_bytes(split, cl, 2) == split_kept * local and work_bytes(split, cl, 2, False) == split_work * local
    assert kept_bytes(whole, cl, 2) == 4 * local
    if name == "autocast":
        assert work_bytes(whole, cl, 2, False) == (4 + 4) * local
