"""Recomputation as apply runs it (``autotune.apply.layers._recompute``): a re-run block gets no inference cache, as
transformers' own gradient checkpointing runs it. With the cache on (transformers' default, in training too), a
checkpointed block wrote its keys and values into it in the forward, kept past the block (2 x H200, 2026-11-30:
4.00 GiB alive at Llama 3 8B's loss under full recomputation, which the plan did not price), and again in the
backward's re-run. Checked on one process in float64: the cache is empty after the forward, whether the model passes
it by keyword (Llama) or by position (GPT-2's blocks), under full (the block) and selective (the attention)
recomputation, and the gradients equal those without recomputation. Planted bugs: the cache left on where it
comes by keyword fails the Llama cases; where it comes by position, GPT-2's."""
import functools
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from autotune.apply.layers import _cache_slots, _rerun  # noqa: E402


def _llama():
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=96))


def _gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


CASES = {"llama, blocks": (_llama, lambda m: m.model.layers),
         "llama, attention (selective)": (_llama, lambda m: [b.self_attn for b in m.model.layers]),
         "gpt2, blocks (cache passed by position)": (_gpt2, lambda m: m.transformer.h)}


@pytest.mark.parametrize("case", CASES)
def test_a_rerun_block_writes_no_cache_and_its_gradients_are_unchanged(case):
    make, targets = CASES[case]
    torch.manual_seed(0)
    plain = make().double()
    rerun = make().double()
    rerun.load_state_dict(plain.state_dict())
    for m in targets(rerun):  # as _recompute wraps them
        m.forward = functools.partial(_rerun, m.forward, _cache_slots(m.forward))
    x = torch.randint(0, 96, (2, 16))
    plain(input_ids=x, labels=x).loss.backward()
    out = rerun(input_ids=x, labels=x)
    out.loss.backward()
    cache = getattr(out, "past_key_values", None)
    assert cache is None or cache.get_seq_length() == 0, "the re-run block wrote into the inference cache"
    for (name, p), q in zip(plain.named_parameters(), rerun.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_autocast_keeps_a_leaf_weights_cast_past_a_rerun_block_but_not_a_gathered_ones():
    """What the memory model's ``cached_gathered`` says (``autotune.sbp.memory.peak_workspace``): inside a
    checkpointed block under autocast, the bf16 cast of a leaf weight (fully_shard's unsharded parameter, a
    replicated one) stays in autocast's cache until the context exits; the cast of a weight computed at use (the
    DTensor path's all-gather, a parametrization) is freed with the block. On the CPU's bfloat16 autocast, whose
    cache follows the same rule as CUDA's."""
    import weakref
    from torch import nn
    from torch.nn.utils import parametrize
    from torch.utils.checkpoint import checkpoint
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16 and out.shape == (32, 32):
                self.made.append(weakref.ref(out))
            return out

    class Gathered(nn.Module):  # the weight computed from what is stored, as the DTensor path's all-gather
        def forward(self, w):
            return w * 1.0

    alive = {}
    for kind in ("leaf", "gathered"):
        lin = nn.Linear(32, 32, bias=False)
        if kind == "gathered":
            parametrize.register_parametrization(lin, "weight", Gathered())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with Casts() as casts:
                checkpoint(lin, torch.randn(4, 32, requires_grad=True), use_reentrant=False)
            alive[kind] = [r() is not None for r in casts.made]
    assert alive == {"leaf": [True], "gathered": [False]}
