"""What Megatron-LM keeps and runs (issue 43), against closed forms: Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"), section 4.2 and Table 2, per layer and micro-batch, with tensor
parallelism sbh (10 + 24/t + 5as/(ht)) and with sequence parallelism sbh/t (34 + 5as/h) bytes (GPT, materialised
attention, dropout); Llama 3's block under sequence parallelism, the count adapted; the sequence-parallel input's
re-gather priced beside the input-gradient GEMM; the dropout's passes; the interleaved schedule's in-flight count on
the published Llama 3 plan."""
import math

import pytest

from calibrate.errors import UserError
from calibrate.profile import Profile
from models import load_model
from autotune import published
from autotune.pipeline.search import inflight
from autotune.reshard.pipeline import INTERLEAVED, interleaved_warmup, simulate
from autotune.sbp.baselines import megatron_assignment
from autotune.sbp.boxing import Coster, Step
from autotune.sbp.cost import Catalogue, Problem, internal_seconds
from autotune.sbp.layers import COLUMN_SP, UNIT_ROLE, make_op, with_recipe
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import layer_seconds

from test_interleaved import _uniform

A100, H100 = "a100-80gb-nvlink+hdr200", "h100-nvlink+ib400"


def megatron(graph, t, sp, recipe="megatron-fp16", dropout=(0.1, 0.1), profile=A100):
    """The Megatron plan on (1, t) of one node of t GPUs, on a problem that holds Megatron's strategies."""
    coster = Coster(Profile.load(profile), Cluster(1, t))
    pr = Problem(graph, coster, None, signatures=(UNIT_ROLE, COLUMN_SP), objective="comm", recipe=recipe,
                 catalogue=Catalogue(coster, recipe, dropout), runnable=False, require_fit=False)
    a = megatron_assignment(pr, (1, 1), (1, t), sequence_parallel=sp)
    assert a is not None
    return pr, a


def block_activations(pr, a) -> float:
    """What one block keeps for the backward of one micro-batch (each layer occurrence as the stage counts it)."""
    start, end = pr.graph.blocks[0]
    return sum(pr.layer_memory(v, pr.choices[v][a[v]]).activations for v in pr.graph.chain[start:end])


S, B_, H, A = 32, 2, 64, 4  # sequence, micro-batch, hidden, heads


def gpt():
    return load_model("gpt", "gpt2", {"attention": "naive", "layers": 1, "hidden": H, "heads": A, "sequence": S,
                                      "max_positions": S, "vocabulary": 128, "batch": B_, "micro_batch": B_})


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_gpt_block_keeps_korthikantis_table_2(t, sp):
    """Korthikanti et al. 2022, Table 2, in bytes (fp16): tensor parallel sbh (10 + 24/t + 5as/(ht)), tensor and
    sequence parallel sbh/t (34 + 5as/h): each layer norm's input 2sbh, the qkv and fc1 inputs 2sbh each (under
    sequence parallelism their shards, 2sbh/t: Megatron's column-parallel layer re-gathers them in the backward),
    Q and K 4sbh/t, V 2sbh/t, the softmax 2as^2b/t, its dropout's mask as^2b/t and output 2as^2b/t, the projection's
    input 2sbh/t, two dropout masks (after the projection, after fc2) sbh each, the GELU's input 8sbh/t and fc2's
    8sbh/t."""
    pr, a = megatron(gpt(), t, sp)
    sbh, as2b = S * B_ * H, A * S * S * B_
    want = sbh * 34 / t + 5 * as2b / t if sp else sbh * (10 + 24 / t) + 5 * as2b / t
    assert block_activations(pr, a) == pytest.approx(want)
    qkv = pr.graph.chain[pr.graph.blocks[0][0] + 1]
    assert pr.choices[qkv][a[qkv]].signature == (COLUMN_SP if sp else "autoddl")


def test_without_dropout_the_masks_and_the_dropped_probabilities_go():
    """No dropout: Table 2 less the two sbh masks and the softmax dropout's 3as^2b (its mask and output)."""
    pr, a = megatron(gpt(), 2, False, dropout=(0.0, 0.0))
    assert block_activations(pr, a) == pytest.approx(S * B_ * H * (8 + 24 / 2) + 2 * A * S * S * B_ / 2)


def test_llama3_block_under_sequence_parallelism_against_korthikantis_count_adapted():
    """Llama 3 405B (h 16384, 128 heads, 8 KV heads of 128, SwiGLU of f 53248, flash attention, no dropout), one
    sequence of s 8192 a micro-batch, t 8 with sequence parallelism, bf16: Korthikanti's 34 sbh/t adapted, per
    layer and micro-batch: the two RMSNorm inputs 4sbh, the qkv and fc1 inputs' shards 2sbh each, Q 2sbh and K, V
    2sbh (kv/a) each (grouped-query attention), the flash core's output O 2sbh and its fp32 log-sum-exp 4asb (no
    softmax kept: Korthikanti's 5as^2b goes), the projection's input 2sbh (counted apart from O, as torch's SDPA
    path makes it: a contiguous copy; where the core writes O in the layout the projection reads, as cuDNN's fused
    attention on Megatron's sbhd, they are one tensor and 2sbh/t less: not modelled), and in place of GELU's 8sbh
    and fc2's 8sbh (f = 4h) SwiGLU's input, gate and up, 4sbf and fc2's input silu(gate) up 2sbf; no dropout
    masks: sbh/t (33.75) + 4asb/t = 540.5 MiB."""
    g = load_model("llama", "llama3-405b", {"layers": 1, "batch": 1, "micro_batch": 1})
    pr, a = megatron(g, 8, True, recipe="megatron-bf16", dropout=(0.0, 0.0), profile=H100)
    s, h, f, heads, kv, t = 8192, 16384, 53248, 128, 8, 8
    sbh = s * h
    want = (4 * sbh + 2 * sbh + 2 * sbh + 2 * 2 * sbh * kv / heads + 2 * sbh + 2 * sbh + 2 * sbh
            + 4 * s * f + 2 * s * f) / t + 4 * heads * s / t
    assert want == 540.5 * 2**20
    assert block_activations(pr, a) == pytest.approx(want)
    # the users' recipe runs torch's ColwiseParallel, which keeps the gathered input: its plan unchanged
    auto = Problem(g, Coster(Profile.load(H100), Cluster(1, 8)), None, signatures=(UNIT_ROLE, COLUMN_SP),
                   objective="comm", runnable=False, require_fit=False)
    b = megatron_assignment(auto, (1, 1), (1, 8), sequence_parallel=True)
    assert {auto.choices[v][b[v]].signature for v in auto.graph.chain if auto.ops[v].layer.kind == "matmul"} == \
        {"autoddl"}


def test_the_sequence_parallel_inputs_regather_and_its_gradients_reduce_scatter_run_beside_the_backward_gemms():
    """Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication all-gathers the kept shard asynchronously and
    computes dI = dO W^T meanwhile, then reduce-scatters dI into the sequence shard asynchronously and computes
    dW = dO^T X meanwhile: the backward's boxing inside qkv is, for C each collective (the all-gather, then the
    reduce-scatter, of the whole input: s b h bf16 over the node's 8 GPUs), max(0, C - G) + (k - 1) min(C, G), G the
    forward-sized GEMM (s, h, the qkv columns / t), k the profile's slowdown beside that collective; nothing in the
    forward, and no boxing between the norm and qkv in the backward (qkv returns its input's gradient as the norm's
    sequence shard)."""
    from autotune.sbp.tables import edge_steps
    g = load_model("llama", "llama3-405b", {"layers": 1, "batch": 1, "micro_batch": 1})
    pr, a = megatron(g, 8, True, recipe="megatron-bf16", dropout=(0.0, 0.0), profile=H100)
    u, v = pr.graph.chain[pr.graph.blocks[0][0]:pr.graph.blocks[0][0] + 2]
    s = pr.choices[v][a[v]]
    cm, cl = pr.coster.profile.compute, pr.cluster
    axes, nbytes = tuple(range(len(cl.axis_sizes))), 8192 * 16384 * 2
    gemm = cm.matmul_seconds(8192, 16384, (128 + 2 * 8) * 128 // 8, 2)
    want = 0.0
    for op, name in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter")):
        c, k = pr.coster.step_time(Step(op, axes, nbytes)), cm.overlap_slowdown(name)
        want += max(0.0, c - gemm) + (k - 1) * min(c, gemm)
    f, b = internal_seconds(pr.ops[v], s, cl, pr.coster, cm, 2)
    assert f == 0 and b == pytest.approx(want)
    assert 0 < gemm < pr.coster.step_time(Step("allgather", axes, nbytes))  # on this profile part of it shows
    whole = internal_seconds(pr.ops[v], s, cl, pr.coster)[1]  # no compute model: all of both
    assert whole == pytest.approx(sum(pr.coster.step_time(Step(op, axes, nbytes)) for op in ("allgather", "reducescatter")))
    fwd, bwd = edge_steps(pr.choices[u][a[u]], s, pr.ops[u].out_shape, cl, (2, 2))
    assert [st.op for st in fwd] == ["allgather"] and bwd == ()


def test_dropouts_passes_at_the_elementwise_bandwidth():
    """Megatron-LM's dropout, per element: on the probabilities its own kernel (forward read, write and the 1-byte
    mask: 2a + 1 bytes; backward read the gradient and the mask, write: 2a + 1), in the residual add's
    bias-dropout-add the forward's mask (1 byte, no launch of its own) and the backward's 2a + 1."""
    g = gpt()
    cm = Profile.load(A100).compute
    cl = Cluster(1, 1)
    ew = cm.op_Bps["elementwise"]
    for kind, extra in (("attention", B_ * A * S * S), ("residual", S * B_ * H)):
        v = next(v for v in g.chain if g.layers[v].kind == kind)
        op = make_op(g.layers[v])
        s0 = op.strategies(cl)[0]
        on, off = (layer_seconds(op, with_recipe(s0, op.layer, "megatron-fp16", 2, d), cl, cm, 2)
                   for d in ((0.1, 0.1), (0.0, 0.0)))
        fwd = extra * 5 / ew + cm.launch_s if kind == "attention" else extra / ew
        assert on[0] - off[0] == pytest.approx(fwd) and on[1] - off[1] == pytest.approx(extra * 5 / ew + cm.launch_s)
    with pytest.raises(UserError, match="Megatron-LM's recipes only"):
        with_recipe(s0, op.layer, "autocast", 2, (0.1, 0.1))


def test_every_published_case_states_its_dropout():
    cases = {c["id"]: c for c in published.load_cases()}
    for cid, c in cases.items():
        assert published.dropout(c) == ((0.1, 0.1) if cid.startswith("megatron") else (0.0, 0.0))
    # the printed configuration names the dropout where it is not Megatron-LM's default
    from autotune.sbp.techniques import Techniques
    terms = [published.megatron_terms(8, 16, 128, 1, 2048, Techniques(), 126, d) for d in ((0.1, 0.1), (0.0, 0.0))]
    assert "dropout" not in terms[0] and "--attention-dropout 0 --hidden-dropout 0" in terms[1]
    bad = dict(cases["llama3-405b-16k"])
    del bad["dropout"]
    with pytest.raises(UserError, match="dropout"):
        published.dropout(bad)


@pytest.mark.parametrize("v", [2, 8])
def test_the_published_llama3_plans_in_flight_count_is_torchs_and_megatrons(v):
    """p 16, 16 micro-batches a data-parallel rank (Table 4: 16 sequences of 8192, one a micro-batch), v chunks a
    rank (8 in the case, 2 as often assumed): torch's ScheduleInterleaved1F1B (``_get_warmup_ops``) and Megatron-LM
    warm up min((v - 1) p + 2 (p - 1 - r), m v) chunks, so rank 0 runs every forward first and keeps all m v
    chunks: all 16 micro-batches of its layers, not one more; the last rank keeps (v - 1) p + 1 chunks (the first
    steady forward's too), rounded up to whole micro-batches of its layers."""
    p, m = 16, 16
    assert interleaved_warmup(0, p, v, m) == min((v - 1) * p + 2 * (p - 1), m * v) == m * v
    assert inflight(INTERLEAVED, 0, p, m, v) == m
    peaks = simulate(_uniform(p, v, m), INTERLEAVED, ranks=p).peak_activations
    assert peaks[0] == m * v
    assert peaks[p - 1] == (v - 1) * p + 1 and inflight(INTERLEAVED, p - 1, p, m, v) == math.ceil(((v - 1) * p + 1) / v)
    for r in range(p):
        assert peaks[r] == min(interleaved_warmup(r, p, v, m) + 1, m * v)
        assert inflight(INTERLEAVED, r, p, m, v) == math.ceil(peaks[r] / v)
