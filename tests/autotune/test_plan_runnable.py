"""Every plan the search returns is one apply can take (``autotune.plan.runnable``): shapes of every model
family (Llama, Qwen2, Mistral and GPT-2 as Hugging Face configs, nanoGPT as the gpt kind), cluster sizes,
micro-batches of 1, 2 and more, pipeline schedules, drawn by hypothesis; the best plan and every baseline, each stage of a
pipelined one. A planted bug (tokens split into pieces of sequences) fails it."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from calibrate.errors import UserError
from calibrate.profile import DEFAULT_PROFILE, Profile
from models import load_model

import autotune
from autotune.plan.runnable import unrunnable
from autotune.sbp.mesh import Cluster
from autotune.sbp.search import Budget

FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "nanogpt")


def config(family: str, layers: int, heads: int, groups: int, head_dim: int, vocabulary: int) -> dict:
    """A Hugging Face config.json of ``family`` (``heads`` query heads in ``groups`` K/V heads)."""
    hidden = heads * head_dim
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "n_layer": layers, "n_embd": hidden, "n_head": heads,
                "vocab_size": vocabulary, "n_positions": 64}
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[family]
    return {"architectures": [arch], "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": groups, "intermediate_size": 3 * hidden, "vocab_size": vocabulary,
            "max_position_embeddings": 64}


def model(tmp_path, family, layers, heads, groups, head_dim, vocabulary, micro, count):
    sizes = {"sequence": 16, "micro_batch": micro, "batch": micro * count}
    if family == "nanogpt":
        return load_model("gpt", "gpt2", {"layers": layers, "hidden": heads * head_dim, "heads": heads,
                                          "vocabulary": vocabulary, "max_positions": 64, **sizes})
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(config(family, layers, heads, groups, head_dim, vocabulary)))
    return load_model(str(path), None, sizes)


def returned(plans) -> list[tuple[str, object]]:
    """(strategy, typed plan) of the best plan and every baseline, a pipelined one's stages each."""
    out = []
    for p in [plans.best, *plans.baselines]:
        out += [(p.strategy, t) for t in ([s.plan for s in p.stages] or [p])]
    return out


def search(graph, nodes, gpus, schedule="1f1b"):
    return autotune.search(graph, Cluster(nodes, gpus), PROFILE, memory_limit=80 * 2**30,
                           budget=Budget(steps=40), compare=(), pipeline="auto", schedule=schedule)


PROFILE = Profile.load(DEFAULT_PROFILE)


@settings(max_examples=8, deadline=None, phases=(Phase.explicit, Phase.generate),  # no shrinking: each a search
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(FAMILIES), layers=st.integers(1, 2), heads=st.sampled_from((2, 3, 4, 6, 8)),
       grouped=st.booleans(), head_dim=st.sampled_from((8, 16)), vocabulary=st.sampled_from((96, 100, 128, 250)),
       micro=st.sampled_from((1, 2, 4, 6)), count=st.integers(1, 2), nodes=st.integers(1, 2),
       gpus=st.sampled_from((1, 2, 4)), schedule=st.sampled_from(("1f1b", "gpipe", "eager-1f1b")))
def test_every_returned_plan_is_one_apply_can_take(tmp_path, family, layers, heads, grouped, head_dim, vocabulary,
                                                   micro, count, nodes, gpus, schedule):
    groups = next(g for g in (2, 1) if heads % g == 0) if grouped else heads
    graph = model(tmp_path, family, layers, heads, groups, head_dim, vocabulary, micro, count)
    try:
        plans = search(graph, nodes, gpus, schedule)
    except UserError:  # no plan (one line: e.g. some layer has no strategy as the sizes do not divide)
        return
    found = {name: bad for name, typed in returned(plans) if (bad := unrunnable(typed))}
    assert not found, found


def test_a_planted_bug_splitting_sequences_fails_the_check(tmp_path, monkeypatch):
    """The search made to split a micro-batch of 1 over 2 devices by tokens (sequence pieces, which apply
    does not cut): the returned plans break the rule."""
    from autotune.pipeline import stage
    from autotune.sbp import cost
    graph = model(tmp_path, "llama", 1, 4, 2, 8, 128, 1, 2)
    assert not any(unrunnable(t) for _, t in returned(search(graph, 1, 2)))
    for module in (cost, stage):
        monkeypatch.setattr(module, "rows_of", lambda graph: None)
    bad = [b for _, t in returned(search(graph, 1, 2)) for b in unrunnable(t)]
    assert any("micro-batch 1 over 2 devices" in b for b in bad), bad


@pytest.mark.parametrize("micro", [1, 2])
def test_gpt2s_fused_qkv_is_stated_and_small_micro_batches_are_not_split_further(tmp_path, micro):
    graph = model(tmp_path, "gpt2", 1, 4, 4, 8, 128, micro, 2)
    plans = returned(search(graph, 1, 4))
    assert all(t.layer("attention").dims["qkv_fused"] == 1 for _, t in plans)
    assert not {name: bad for name, t in plans if (bad := unrunnable(t))}


def test_a_baseline_without_a_placement_does_not_end_the_search(tmp_path):
    """GPT-2 with an odd vocabulary, micro-batches of one sequence on 2 GPUs: the logits have no placement of S and
    B alone, so the "S/B only" baseline has no plan. The command said so by ending with that error after its
    search had found plans; now it leaves that baseline out (as SUMMA's) and returns the others."""
    graph = model(tmp_path, "gpt2", 1, 4, 4, 8, 97, 1, 7)
    plans = search(graph, 1, 2)
    assert plans.best is not None and not any(b.strategy.startswith("S/B only") for b in plans.baselines)


def test_one_device_has_no_fsdp_mode_and_a_host_bound_stage_keeps_the_searched_mode(tmp_path):
    """On one device sharding is none only (FSDP over no axis took a one-GPU stage on a tie). GPT-2 XL's width, 8
    layers of micro-batches of one 256-token sequence on 2 GPUs: each one-GPU stage runs at the host's pace, which
    prices its plain and recomputed plans alike; it keeps the plain one (on such a tie the last stage had taken full
    recomputation)."""
    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.fit import sharding_modes
    small = model(tmp_path, "gpt2", 2, 4, 4, 8, 97, 1, 7)
    assert sharding_modes(Problem(small, Coster(PROFILE, Cluster(1, 1)), None)) == [None]
    assert sharding_modes(Problem(small, Coster(PROFILE, Cluster(1, 2)), None)) == [None, (0,)]
    path = tmp_path / "gpt2-xl-8.json"
    path.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 8, "n_embd": 1600, "n_head": 25,
                                "vocab_size": 50257, "n_positions": 1024}))
    best = search(load_model(str(path), None, {"sequence": 256, "micro_batch": 1, "batch": 7}), 1, 2).best
    assert best.stages and all(s.plan.recompute == "none" and s.plan.sharding_mode == "none" for s in best.stages)
