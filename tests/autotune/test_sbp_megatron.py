"""Megatron's communication (Shoeybi et al., Fig. 3 and 4: f and g), the loss every model ends in,
and the memory accounting, against closed forms."""
import math

import pytest

from calibrate.collectives import Collective
from calibrate.profile import Group, Profile
from models import load_model
from autotune.sbp.baselines import data_parallel, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.memory import precision
from autotune.sbp.mesh import Cluster
from autotune.sbp.search import Budget, make_search

DAINT = Profile.load("piz-daint")
A100 = Profile.load("gcp-a100")


def test_every_model_ends_in_a_loss():
    for kind in ("gpt", "mlp", "vgg13", "u-transformer"):
        assert load_model(kind).layers[-1].kind == "loss"


def test_issue_mlp_megatron_pays_the_output_all_reduce():
    # MLP 1024-4096-1024, batch 64, fp16, 4 Piz Daint nodes, Megatron t = 4: fc0 column-parallel, fc1
    # row-parallel (output partial); the loss needs the output whole: one forward all-reduce of
    # 64 x 1024 fp16 over 4 nodes, 2 * 3 alpha + 2 * 3/4 * 131072 beta = 83 us by the piz-daint profile.
    # Backward: the loss runs on every device, its gradient is whole (Megatron's g is the identity
    # backward); Megatron's f all-reduces the gradient of the MLP's input, here the data: not computed.
    g = load_model("mlp", None, {"dims": [1024, 4096, 1024], "batch": 64, "micro_batch": 64})
    pr = Problem(g, Coster(DAINT, Cluster(4, 1)), None)
    a = megatron_assignment(pr, (1, 1), (4, 1))
    want = DAINT.time(Collective.ALLREDUCE, 64 * 1024 * 2, Group(4, 4))
    assert want == pytest.approx(83.13e-6, rel=1e-3)
    assert pr.cost(a) == pytest.approx(want, rel=1e-12)
    best = make_search("exhaustive").run(pr, Budget(), None)
    assert 0 < best.cost <= pr.cost(a)


def _gpt(layers, d, t, nodes=1, gpus=4, profile=A100):
    g = load_model("gpt", None, {"layers": layers, "hidden": 256, "heads": 8, "sequence": 64, "vocabulary": 1024,
                                 "batch": 16, "micro_batch": 8})
    pr = Problem(g, Coster(profile, Cluster(nodes, gpus)), None)
    return pr, megatron_assignment(pr, (1, d), (1, t))


def test_megatron_transformer_layer_is_four_all_reduces():
    # Per layer and micro-batch, Megatron moves 4 all-reduces of the (tokens / d) x hidden activation over t:
    # forward g after the attention's and the MLP's row-parallel layer, backward f before the column-parallel
    # QKV and FC1. Our model books each backward f at the P -> B edge that precedes it (proj -> ln2,
    # fc2 -> next ln1): the layer norm between is linear in its gradient. So one more layer adds exactly 4.
    tokens, hidden = 8 * 64, 256
    for d, t in ((1, 4), (2, 2)):
        p1, a1 = _gpt(1, d, t)
        p2, a2 = _gpt(2, d, t)
        ar = A100.time(Collective.ALLREDUCE, tokens // d * hidden * 2, Group(t))
        # with d > 1, one more layer also adds its weights' gradient all-reduce over d (once per step)
        sync = sum(A100.time(Collective.ALLREDUCE, n * 2, Group(d)) for n in
                   (256 * 768 // t, 256 * 256 // t, 256 * 1024 // t, 1024 * 256 // t, 2 * 256, 2 * 256)) if d > 1 else 0
        assert p2.cost(a2) - p1.cost(a1) == pytest.approx(p1.mb * 4 * ar + sync, rel=1e-9)


def test_megatron_whole_gpt_closed_form():
    # 1 layer, d = 1, t = 4, per micro-batch: the vocabulary-parallel embedding's g and the QKV's f
    # (2 all-reduces), the attention's g and FC1's f (2), FC2's g before ln_f and the logits' f (2): 4 L + 2;
    # and the vocabulary-parallel loss's statistics, one forward all-reduce of 2 fp32 per token. No gradient sync.
    pr, a = _gpt(1, 1, 4)
    tokens, hidden = 8 * 64, 256
    ar = A100.time(Collective.ALLREDUCE, tokens * hidden * 2, Group(4))
    stats = A100.time(Collective.ALLREDUCE, tokens * 2 * 4, Group(4))
    assert pr.cost(a) == pytest.approx(pr.mb * (6 * ar + stats), rel=1e-12)


def test_memory_accounting_data_parallel_closed_form():
    # Data parallel on 4 GPUs, mixed precision: every parameter whole on each device at 2 + 2 + 12 bytes;
    # one micro-batch's activations split over 4: every layer's input plus the attention probabilities.
    L, h, heads, s, v, mb = 2, 256, 8, 64, 1024, 8
    g = load_model("gpt", None, {"layers": L, "hidden": h, "heads": heads, "sequence": s, "vocabulary": v,
                                 "batch": 16, "micro_batch": mb})
    pr = Problem(g, Coster(A100, Cluster(1, 4)), None)
    a = data_parallel(pr)
    params = g.parameters()
    t = mb * s // 4
    per_layer_inputs = t * (h + h + 3 * h + h + h + h + 4 * h + 4 * h)  # ln1 qkv attention proj ln2 fc1 gelu fc2
    acts = L * per_layer_inputs + L * (mb // 4) * heads * s * s + t * h + t * h  # + ln_f's and logits' inputs
    m = pr.memory_breakdown(a)
    # bf16 autocast over fp32 parameters: 4 + 4 + 8 bytes a parameter, and the bf16 copies of the matmul
    # weights (all but the embedding's and the layer norms') kept for the backward, 2 bytes an element
    assert (m.parameters, m.gradients, m.optimizer) == (4 * params, 4 * params, 8 * params)
    matmul = L * (h * 3 * h + h * h + h * 4 * h + 4 * h * h) + h * v
    assert m.activations == 2 * acts + 4 * t * v + 2 * matmul  # the loss keeps fp32 probabilities
    # the peak: the logits' backward (2 micro-batches: its new bf16 weight gradient and that cast to fp32)
    # while the loss's probabilities are freed: + 2 (t h + t v) + (2 + 4) h v - 4 t v, above the loss's 2 t v
    assert m.workspace == 2 * (t * h + t * v) + 6 * h * v - 4 * t * v
    assert m.total == pr.memory_of(a) + m.workspace == pr.peak_memory(a)
    assert sum(precision(2)) == sum(precision(4)) == 16


def test_memory_accounting_fp32_and_split_weights():
    # fp32 (act_bytes 4): 4 + 4 + 8 bytes a parameter; Megatron t = 4 holds a quarter of every matmul weight
    g = load_model("gpt", None, {"layers": 1, "hidden": 256, "heads": 8, "sequence": 64, "vocabulary": 1024,
                                 "batch": 16, "micro_batch": 8, "act_bytes": 4})
    pr = Problem(g, Coster(A100, Cluster(1, 4)), None)
    a = megatron_assignment(pr, (1, 1), (1, 4))
    m = pr.memory_breakdown(a)
    local = (1024 * 256 + 256 * 768 + 256 * 256 + 256 * 1024 + 1024 * 256 + 256 * 1024) // 4 + 3 * 2 * 256
    assert (m.parameters, m.gradients, m.optimizer) == (4 * local, 4 * local, 8 * local)
    assert math.isclose(m.total, pr.memory_of(a) + m.workspace)
