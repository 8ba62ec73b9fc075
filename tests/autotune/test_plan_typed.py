"""The typed plan (autotune.plan): converted from the search's plan.json and back through its record, its
loader's one-line errors; apply in one process (shapes checked, recomputation applied, nothing placed) and its
errors before any weight moves."""
import json
import subprocess
import sys

import numpy as np
import pytest

from apply_plans import LLAMA, data_parallel, typed_plan
from autotune.plan import TypedPlan, load_plan
from autotune.sbp.baselines import data_parallel as dp_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.plan.build import build as build_plan, placed
from autotune.plan.file import PlanFile
from calibrate.errors import UserError
from calibrate.profile import Profile
from models import load_model

TINY = dict(layers=2, hidden=8, heads=4, sequence=4, vocabulary=16, batch=8, micro_batch=4, ffn=32)


@pytest.fixture(scope="module")
def plan_file() -> dict:
    problem = Problem(load_model("gpt", None, TINY), Coster(Profile.load("h200-nvlink+ib400"), Cluster(2, 2)))
    best = build_plan(problem, problem.random_assignment(np.random.default_rng(1)), "random")
    return PlanFile(best, [build_plan(problem, dp_assignment(problem), "data parallel")]).to_dict()


def test_search_plan_round_trips(plan_file, tmp_path):
    typed = load_plan(plan_file)
    best = plan_file["best"]
    assert typed.mesh.sizes == (2, 2) and typed.mesh.names == ("n0", "g0")
    assert [lay.name for lay in typed.layers] == [lay["name"] for lay in best["layers"]]
    assert typed.costs.total_s == best["costs"]["total_s"] and plan_file["baselines"][0]["strategy"] == "data parallel"
    assert typed.costs.memory == best["costs"]["memory"] and typed.apply_path == best["apply_path"]
    proj = typed.layer("proj")
    assert proj.weight("weight").shape == (8, 8) and len(proj.input) == 2
    typed.save(tmp_path / "typed.json")
    assert load_plan(tmp_path / "typed.json") == typed
    (tmp_path / "plan.json").write_text(json.dumps(plan_file))
    assert load_plan(tmp_path / "plan.json") == typed
    old = dict(plan_file, version=1)  # an old plan.json: one line naming the fix
    with pytest.raises(UserError, match="version 1; this tool reads version 2: re-run python -m autotune --out DIR"):
        load_plan(old)


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["layers"][2]["weights"][0].update(placements=["S2", "B"]), "placement 'S2'"),
    (lambda d: d["layers"][2]["costs"].update(redistribution_s=float("nan")), "not a finite number"),
    (lambda d: d["mesh"].update(sizes=[4]), "not the fine axes"),
    (lambda d: d.update(recompute="half"), "recompute"),
    (lambda d: d.update(sharding={"mode": "fsdp", "axes": [5]}), "sharding.axes"),
    (lambda d: d.update(micro_batches=0), "micro_batches"),
])
def test_loader_rejects_bad_plans_in_one_line(plan_file, edit, words):
    d = json.loads(json.dumps(load_plan(plan_file).to_dict()))
    edit(d)
    with pytest.raises(UserError) as e:
        load_plan(d)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_import_autotune_does_not_import_torch():
    code = "import sys, autotune, autotune.plan; assert 'torch' not in sys.modules; autotune.apply"
    subprocess.run([sys.executable, "-c", code], check=True)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_llama(**over):
    c = {**LLAMA, **over}
    cfg = transformers.LlamaConfig(vocab_size=c["vocabulary"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
                                   num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                                   num_key_value_heads=c["kv_heads"], max_position_embeddings=c["sequence"])
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def one_device(recompute="none", **over) -> TypedPlan:
    cfg = {**LLAMA, **over}
    return typed_plan(cfg, 1, 1, data_parallel(cfg, axes=1), "one device", recompute=recompute)


def test_apply_on_one_process_places_nothing_and_recomputes():
    import autotune
    ids = torch.randint(0, LLAMA["vocabulary"], (2, LLAMA["sequence"]))
    ref = tiny_llama()
    want = ref(input_ids=ids).logits
    want.sum().backward()
    model = autotune.apply(one_device("full"), tiny_llama())
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    got = model(input_ids=ids).logits
    got.sum().backward()
    assert torch.equal(got, want)
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12), name
    assert isinstance(model.model.layers[0].forward, __import__("functools").partial)  # checkpointed


def test_apply_errors_before_any_weight_moves():
    import autotune
    with pytest.raises(UserError, match="hidden|computes"):
        autotune.apply(one_device(), tiny_llama(hidden=32, head_dim=8))
    with pytest.raises(UserError, match="2 blocks but the plan's model has 3"):
        autotune.apply(one_device(layers=3), tiny_llama())
    with pytest.raises(UserError, match="4 devices but 1 processes"):
        autotune.apply(typed_plan(LLAMA, 2, 2, data_parallel(LLAMA), "dp"), tiny_llama())
    with pytest.raises(UserError, match="mapping="):
        autotune.apply(one_device(), torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_mapping_names_the_modules_of_any_model():
    import autotune
    model = tiny_llama()
    mapping = {"embedding": "model.embed_tokens", "ln1": "model.layers.*.input_layernorm",
               "qkv": "model.layers.*.self_attn.[qkv]_proj", "proj": "model.layers.*.self_attn.o_proj",
               "ln2": "model.layers.*.post_attention_layernorm", "fc1": "model.layers.*.mlp.[gu][ap]*_proj",
               "fc2": "model.layers.*.mlp.down_proj", "ln_f": "model.norm", "logits": "lm_head"}
    assert autotune.apply(one_device(), model, mapping=mapping) is model
    with pytest.raises(UserError, match="no module .* matches"):
        autotune.apply(one_device(), model, mapping={**mapping, "proj": "model.layers.*.nothing"})


def test_micro_batches_split_the_batch():
    import autotune
    plan = one_device()
    parts = autotune.micro_batches(plan, {"ids": torch.arange(16).reshape(8, 2)})
    assert len(parts) == plan.micro_batches == 2 and torch.equal(parts[1]["ids"], torch.arange(8, 16).reshape(4, 2))
    with pytest.raises(UserError, match="micro-batches"):
        autotune.micro_batches(plan, torch.zeros(3))


def test_gpt2_modules_are_found_and_checked():
    """GPT-2's Conv1D layers ([in, out]), its position table and its tied logits, in one process."""
    import autotune
    from apply_plans import GPT
    c = {**GPT, "sequence": 8}
    cfg = transformers.GPT2Config(vocab_size=c["vocabulary"], n_positions=c["sequence"], n_embd=c["hidden"],
                                  n_layer=c["layers"], n_head=c["heads"], n_inner=c["ffn"], bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()  # no dropout
    plan = typed_plan(c, 1, 1, data_parallel(c, axes=1), "one device")
    ids = torch.randint(0, c["vocabulary"], (2, c["sequence"]))
    want = model(input_ids=ids).logits
    assert torch.equal(autotune.apply(plan, model)(input_ids=ids).logits, want)
    with pytest.raises(UserError, match="computes"):
        autotune.apply(typed_plan({**c, "ffn": 64}, 1, 1, data_parallel(c, axes=1), "x"), model)


def test_which_plans_take_fully_shard():
    """Pure FSDP, HSDP (trailing axes sharded) and TP + FSDP (one trailing column/row-wise axis) take
    fully_shard; everything else, and a TP + FSDP plan on a module with tied weights or GPT-2's Conv1D, the
    DTensor path."""
    from apply_plans import GPT, random_partial, tp_data, vocab_parallel
    from autotune.plan.layouts import FullyShard, fully_shard_layout, fully_shard_plan
    from autotune.apply.place import placement_path
    dp, tp = data_parallel(LLAMA), tp_data(LLAMA)
    assert fully_shard_layout(typed_plan(LLAMA, 2, 2, dp, "FSDP", fsdp_axes=(0, 1))) == FullyShard((0, 1), (0, 1), None)
    assert fully_shard_layout(typed_plan(LLAMA, 2, 2, dp, "HSDP", fsdp_axes=(1,))) == FullyShard((0, 1), (1,), None)
    assert fully_shard_layout(typed_plan(LLAMA, 2, 2, tp, "TP+FSDP", fsdp_axes=(0,))) == FullyShard((0,), (0,), 1)
    wrong = dict(tp, proj=(tp["proj"][0], tp["proj"][1], {"weight": ("B", "S1")}))  # not row-wise
    for plan in (typed_plan(LLAMA, 2, 2, dp, "DP"), typed_plan(LLAMA, 2, 2, dp, "sharded across", fsdp_axes=(0,)),
                 typed_plan(LLAMA, 2, 2, wrong, "TP+FSDP, proj not row-wise", fsdp_axes=(0,)),
                 typed_plan(LLAMA, 2, 2, tp, "TP without FSDP"),
                 typed_plan(LLAMA, 2, 2, vocab_parallel(LLAMA), "vocabulary", fsdp_axes=(0,)),
                 typed_plan(LLAMA, 2, 2, random_partial(LLAMA, (2, 2), 1), "random", fsdp_axes=(0, 1))):
        assert fully_shard_layout(plan) is None, plan.strategy
    from models.modules import build
    gpt = dict(GPT, ffn=4 * GPT["hidden"])
    plan = typed_plan(gpt, 2, 2, tp_data(gpt), "TP+FSDP", fsdp_axes=(0,))
    model = build(gpt)
    # tied logits split by vocabulary as the embedding is: torch's styles, the weight tied again (``tensor.ties``)
    assert fully_shard_plan(plan) and placement_path(plan, model, model.plan_mapping) == "fully_shard"
    assert placement_path(plan, build(dict(gpt, tied=False)), model.plan_mapping) == "fully_shard"
    whole = dict(tp_data(gpt), logits=(("S0", "B"), ("S0", "B"), {"weight": ("B", "B")}))  # the head not split
    assert placement_path(typed_plan(gpt, 2, 2, whole, "TP+FSDP, the head whole", fsdp_axes=(0,)), model,
                          model.plan_mapping) == "dtensor"  # one use split, the other not: the DTensor path


@pytest.mark.parametrize("kind, cluster", [("gpt", Cluster(2, 2)), ("llama", Cluster(1, 4)), ("gpt", Cluster(1, 1))])
def test_the_search_builds_the_plan_that_plan_json_holds(kind, cluster):
    """``placed`` (the search's assignment read from its strategies, the pipeline search's cheap form) has the
    layers ``build`` prices; the built plan survives its record."""
    from dataclasses import replace
    fields = dict(TINY, kv_heads=2) if kind == "llama" else TINY
    problem = Problem(load_model(kind, None, fields), Coster(Profile.load("h200-nvlink+ib400"), cluster))
    for seed in range(3):
        assign = problem.random_assignment(np.random.default_rng(seed))
        held, built = placed(problem, assign, "random"), build_plan(problem, assign, "random")
        assert held.layers == tuple(replace(lay, costs={}, collectives=(), compute_source="") for lay in built.layers)
        assert load_plan(json.loads(json.dumps(built.to_dict()))).to_dict() == built.to_dict()
