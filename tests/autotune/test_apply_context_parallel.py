"""Context parallelism run by apply (issue 43; ``autotune.apply.context``): the Megatron plan with its attention
context-parallel ("attention-cp" on (d / c, c, t), the search's ``megatron_assignment(..., context=)``) is read
as a DDP, tensor or fully_shard plan with context axes (``context_axes``, no torch), and ``autotune.apply``
places it: each context group's ranks hold the same sequences, each its two balanced chunks (global positions,
labels shifted over the whole sequence), K and V all-gathered over the group. On gloo in float64, the README's
step (``model(input_ids=, labels=).loss``, each rank its ``data_piece``) gives the losses and parameters of one
process after two Adam steps (the model's causal-LM loss kept in float64: ``loss64``), for transformers' Llama
(rotary positions, grouped K/V heads), Qwen2 (biased q, k, v) and GPT-2 (learned positions), at c = 2 on two
ranks, c = 2 beside t = 2, c = 2 under FSDP over all four ranks (torchtitan's FSDP + CP) and c = 4 on four.
Planted bugs fail it: the chunks taken in order (unbalanced: rank 0 the first half), the labels shifted per
chunk, K and V not gathered in the sequence's order; and, once by hand, the gradients of K and V not summed over
the group, the loss not scaled by c. The search offers it for a long sequence and exports it."""
import os
from unittest import mock

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)

from apply_plans import GPT  # noqa: E402
from autotune.apply import context  # noqa: E402
from gloo_runner import run_on_gloo  # noqa: E402
import test_apply_distributed  # noqa: E402
from test_apply_distributed import mismatch  # noqa: E402
from tiny_models import hf_llama  # noqa: E402

CFG = dict(kind="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, sequence=16, vocabulary=64,
           batch=4, micro_batch=2)


def cp_plan(cfg: dict, d: tuple, t: tuple, c: int, cluster: tuple, fsdp: bool = False):
    """The search's Megatron plan on (d, t) with context parallelism over ``c`` of the d ranks (``fsdp``: every
    weight sharded over every axis, torchtitan's FSDP + CP)."""
    from autotune.pipeline.threed import context_role
    from autotune.plan import load_plan
    from autotune.plan.build import build as build_plan
    from autotune.sbp.baselines import megatron_assignment
    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.memory import Mode
    from autotune.sbp.mesh import Cluster
    from autotune.sbp.techniques import context_parallel
    from calibrate.profile import Profile
    from models import load_model
    fields = dict({k: v for k, v in cfg.items() if k not in ("kind", "family")}, attention="flash")
    if cfg["kind"] == "gpt":
        fields.update(residual=True, bias=True, positions="learned")
    graph = context_parallel(load_model(cfg["kind"], None, fields), c)
    problem = Problem(graph, Coster(Profile.load("h200-nvlink+ib400"), Cluster(*cluster)), require_fit=False,
                      runnable=False)
    if fsdp:
        problem = problem.with_mode(Mode("none", tuple(range(len(problem.cluster.axis_sizes)))))
    assign = megatron_assignment(problem, d, t, context=context_role(d, c))
    return load_plan(build_plan(problem, assign, f"Megatron d={d} t={t} context {c}"))


def loss64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **_):
    """transformers' ``ForCausalLMLoss`` without its upcast to float32 (which one process, a mean, and the ranks,
    a sum over the group's tokens, would round apart)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                             ignore_index=ignore_index,
                                             reduction="mean" if num_items_in_batch is None else "sum")
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def model_of(cfg: dict):
    model = _model_of(cfg)
    model.loss_function = loss64
    return model


def _model_of(cfg: dict):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM
    family = cfg.get("family", "llama")
    if family == "llama":
        return hf_llama(cfg, 0)
    torch.manual_seed(0)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=cfg["vocabulary"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
            num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
            max_position_embeddings=cfg["sequence"], attn_implementation="sdpa")).double()
    return GPT2LMHeadModel(GPT2Config(vocab_size=cfg["vocabulary"], n_embd=cfg["hidden"], n_layer=cfg["layers"],
                                      n_head=cfg["heads"], n_positions=cfg["sequence"], n_inner=cfg["ffn"],
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      attn_implementation="sdpa")).double()


def own_loss(model, ids):
    """The README's step: the model's own loss of ``ids[:, :-1]`` (``labels``), which context parallelism cuts."""
    return model(input_ids=ids[:, :-1], labels=ids[:, :-1], use_cache=False).loss


def train(model, plan, cfg):
    return test_apply_distributed.train(model, plan, cfg, own_loss)


def _placed(cfg, plan):
    import autotune
    model = autotune.apply(plan, model_of(cfg))
    return model._autotune_path, train(model, plan, cfg)


def _one_process(cfg, plan):
    return train(model_of(cfg), plan, cfg)


def _in_order(self, seq, device):
    """Planted: the chunks in order (rank i the i-th of c: the causal work unbalanced), keys gathered alike."""
    n = seq // self.size
    return torch.arange(self.rank * n, (self.rank + 1) * n, device=device)


def _shift_per_chunk(module, args, kwargs, *, cp):
    """Planted: the labels cut first, then shifted inside each rank's tokens (the classic context-parallel bug)."""
    labels = kwargs.get("labels")
    out = context._cut(module, args, dict(kwargs, labels=None), cp=cp)
    if labels is not None:
        mine = labels.index_select(1, cp.positions(labels.shape[1], labels.device))
        shifted = torch.nn.functional.pad(mine[:, 1:], (0, 1), value=context.IGNORE)
        out[1].update(labels=shifted, shift_labels=shifted, num_items_in_batch=int((shifted != -100).sum()))
    return out


def _unordered(self, pieces):
    """Planted: K and V concatenated in rank order, not the sequence's."""
    return torch.cat(pieces, dim=2)


BUGS = {"in order": lambda: mock.patch.object(context.ContextGroup, "positions", _in_order),
        "shift per chunk": lambda: mock.patch.object(context, "_cut", _shift_per_chunk),
        "unordered": lambda: mock.patch.object(context.ContextGroup, "order", _unordered)}


CASES = [  # (model config, d, t, c, cluster, world, FSDP)
    (CFG, (1, 2), (1, 1), 2, (1, 2), 2),
    (CFG, (1, 4), (1, 1), 2, (1, 4), 4, True),
    (dict(CFG, family="qwen2"), (1, 2), (1, 1), 2, (1, 2), 2),
    (dict(GPT, family="gpt2", ffn=4 * GPT["hidden"], tied=True, sequence=16, batch=4, micro_batch=2), (1, 2), (1, 1),
     2, (1, 2), 2),
    (CFG, (1, 2), (1, 2), 2, (1, 4), 4),
    (dict(CFG, micro_batch=1), (1, 4), (1, 1), 4, (1, 4), 4),
]


@pytest.mark.parametrize("start", [0, 8, 24])
def test_block_attention_is_causal_attention(start):
    """``blockattn.attend`` of the queries [start, start + 8) over a dense prefix and a causal square equals those
    rows of causal attention (grouped K/V heads), and so do its gradients, in float64 (the CPU kernel: the
    CUDA one is checked by tests/gpu/context_attention.py)."""
    from autotune.apply.blockattn import attend, chunk_blocks
    g = torch.Generator().manual_seed(start)
    q, k, v = (torch.randn(2, h, 32, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (4, 2, 2))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = want[:, :, start:start + 8]
    got = attend(q[:, :, start:start + 8], k, v, chunk_blocks(start, 8), 8 ** -0.5)
    grad = torch.randn(got.shape, dtype=torch.float64, generator=g)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_the_plan_reads_as_a_local_path_with_context_axes():
    from autotune.plan.layouts import context_axes, plan_path
    assert [(plan_path(p := cp_plan(cfg, d, t, c, cl, *fsdp)), context_axes(p)) for cfg, d, t, c, cl, _, *fsdp in
            CASES] == [("ddp", (0,)), ("fully_shard", (1,)), ("ddp", (0,)), ("ddp", (0,)), ("tensor", (0,)),
                       ("ddp", (0, 1))]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_context_parallel_matches_one_process(case):
    cfg, d, t, c, cluster, world, *fsdp = CASES[case]
    plan = cp_plan(cfg, d, t, c, cluster, *fsdp)
    want = run_on_gloo(_one_process, [(cfg, plan)], 1)[0][0]
    bugs = ("in order", "shift per chunk", "unordered") if case in (0, 4) else ()
    got = run_on_gloo(_placed, [(cfg, plan, None)] + [(cfg, plan, b) for b in bugs], world, bugs=BUGS)
    for rank in got:
        path, result = rank[0] if not isinstance(rank[0], str) else (None, rank[0])
        assert path == ("fully_shard" if fsdp else "tensor" if t[1] > 1 else "ddp") and \
            mismatch(want, result) is None, \
            (path, mismatch(want, result))
        for bug, out in zip(bugs, rank[1:]):
            assert isinstance(out, str) or mismatch(want, out[1]) is not None, f"the planted bug {bug!r} passes"


def test_the_search_offers_context_parallelism_for_a_long_sequence():
    """Llama 3 8B on 1 x 4 H200, sequences of 32,768 (micro-batches of 2): the search tries Megatron and FSDP with
    context parallelism over 2 and 4 (``context_sizes``), each on a path apply runs it by, exported with
    Megatron-LM's ``--context-parallel-size`` and torchtitan's ``context_parallel_degree`` (the data degrees
    without it); at 8,192 tokens none unless asked (``context_parallel=(2,)``); a size that does not divide the
    devices is one line."""
    import autotune
    from autotune.cli.search import parse_context
    from autotune.export import export
    from autotune.plan.layouts import CONTEXT_PATHS, context_axes
    from autotune.sbp.mesh import Cluster
    from autotune.sbp.search import Budget
    from calibrate.errors import UserError
    from models import load_model

    def search(sequence, **kw):
        graph = load_model("llama", "llama3-8b", {"batch": 8, "micro_batch": 2, "sequence": sequence})
        return autotune.search(graph, Cluster(1, 4), "h200-nvlink+ib400", memory_limit=130 * 2**30,
                               budget=Budget(steps=30), compare=(), pipeline="off", **kw)
    found = search(32768)
    cp = {p.strategy.split(" (")[0]: p for p in found.baselines if context_axes(p)}
    assert set(cp) >= {"Megatron, context parallel 2", "FSDP, context parallel 2", "FSDP, context parallel 4"}, cp
    assert all(p.apply_path in CONTEXT_PATHS for p in cp.values())
    fsdp = cp["FSDP, context parallel 4"]
    assert fsdp.apply_path == "fully_shard" and fsdp.costs.fits_memory
    which = f"baseline:{fsdp.strategy}"
    flags = export(found, "megatron", which).text
    assert "--context-parallel-size 4" in flags and "data-parallel size: 1 " in flags
    assert "--micro-batch-size 2" in flags
    titan = export(found, "torchtitan", which).text
    assert "--parallelism.context_parallel_degree 4" in titan and "data_parallel_shard_degree 1" in titan
    assert not any(context_axes(p) for p in search(8192).baselines)
    assert any(context_axes(p) for p in search(8192, context_parallel=(2,)).baselines)
    with pytest.raises(UserError, match="--context-parallel 3 does not divide the 4 devices"):
        parse_context("3", 4)
    assert parse_context("auto", 4) is None and parse_context("1", 4) == (1,)


def test_a_model_context_parallelism_cannot_take_is_one_line():
    """A module without transformers' attention interface, and a sliding window shorter than the sequence:
    ``UserError``s naming the fix (``apply`` raises them before any weight moves)."""
    from calibrate.errors import UserError
    from transformers import MistralConfig, MistralForCausalLM
    with pytest.raises(UserError, match="Hugging Face transformers model"):
        context.check_model(torch.nn.Linear(2, 2), 2, 16)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               sliding_window=8))
    with pytest.raises(UserError, match="sliding window of 8 tokens"):
        context.check_model(mistral, 2, 16)
    context.check_model(mistral, 2, 8)
