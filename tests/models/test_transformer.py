"""The gpt and llama transformer families: graph structure, parameter counts, presets, bad input."""
import json

import pytest

from calibrate.errors import UserError
from models import load_model, presets
from models.graph import Layer
from models.transformer import TransformerConfig, build_transformer

LEGACY = ("autoddl-", "gpt3-")


def _today_gpt(c: dict) -> tuple[list[Layer], list[int], int]:
    """The GPT graph as the builder made it before the transformer families (the reference the
    AutoDDL and GPT-3 presets must keep): layers, chain, parameters."""
    def L(name, kind, **dims):
        return Layer(name, kind, tuple(sorted(dims.items())))
    t, h, v, mb = c["micro_batch"] * c["sequence"], c["hidden"], c["vocabulary"], c["micro_batch"]
    ffn = c.get("ffn", 4 * h)
    layers = [L("embedding", "embedding", tokens=t, k=v, n=h),
              L("ln1", "layernorm", tokens=t, hidden=h), L("qkv", "matmul", tokens=t, k=h, n=3 * h),
              L("attention", "attention", tokens=t, hidden=h, heads=c["heads"], micro_batch=mb),
              L("proj", "matmul", tokens=t, k=h, n=h), L("ln2", "layernorm", tokens=t, hidden=h),
              L("fc1", "matmul", tokens=t, k=h, n=ffn), L("gelu", "pointwise", tokens=t, hidden=ffn),
              L("fc2", "matmul", tokens=t, k=ffn, n=h),
              L("ln_f", "layernorm", tokens=t, hidden=h), L("logits", "matmul", tokens=t, k=h, n=v),
              L("loss", "loss", tokens=t, vocabulary=v)]
    chain = [0] + list(range(1, 9)) * c["layers"] + [9, 10, 11]
    per_block = 4 * h + 3 * h * h + h * h + 2 * h * ffn
    return layers, chain, 2 * v * h + c["layers"] * per_block + 2 * h


@pytest.mark.parametrize("name", [n for n in presets("gpt")[1] if n.startswith(LEGACY)])
def test_autoddl_and_gpt3_presets_keep_their_graph(name):
    g = load_model("gpt", name)
    layers, chain, params = _today_gpt(g.config)
    assert g.layers == layers and g.chain == chain and g.parameters() == params
    assert g.skips == [] and len(g.blocks) == g.config["layers"]


# published counts: GPT-2 (OpenAI's model cards), Llama 3 paper / model cards, Mistral 7B, Qwen2.5 report
PUBLISHED = {("gpt", "gpt2"): 124e6, ("gpt", "gpt2-medium"): 355e6, ("gpt", "gpt2-large"): 774e6,
             ("gpt", "gpt2-xl"): 1.56e9, ("llama", "llama3-8b"): 8.03e9, ("llama", "llama3-70b"): 70.6e9,
             ("llama", "llama3-405b"): 405.9e9, ("llama", "mistral-7b"): 7.24e9, ("llama", "qwen2.5-7b"): 7.62e9,
             ("llama", "qwen2.5-72b"): 72.7e9}


@pytest.mark.parametrize("kind,name", sorted(PUBLISHED))
def test_published_parameter_counts(kind, name):
    assert load_model(kind, name).parameters() == pytest.approx(PUBLISHED[(kind, name)], rel=0.005)


def test_every_new_preset_has_a_source():
    for kind in ("gpt", "llama"):
        for name in presets(kind)[1]:
            assert load_model(kind, name).config["source"]
    assert set(presets("llama")[1]) == {k[1] for k in PUBLISHED if k[0] == "llama"}


def _cfg(kind="llama", **over):
    base = {"layers": 3, "hidden": 64, "heads": 8, "kv_heads": 2, "ffn": 96, "sequence": 16, "vocabulary": 100,
            "batch": 8, "micro_batch": 2}
    return TransformerConfig.from_fields(kind, {**base, **over}, "test")


def _closed_form(c: TransformerConfig) -> int:
    """Parameters of a decoder-only transformer counted tensor by tensor."""
    h, d, q, kv, f, v = c.hidden, c.head_dim, c.heads, c.kv_heads, c.ffn, c.vocabulary
    norm = h * (2 if c.norm == "layernorm" and c.bias else 1)
    attn = h * (q + 2 * kv) * d + c.qkv_bias * (q + 2 * kv) * d + q * d * h + c.bias * h
    up = 2 * f if c.mlp == "swiglu" else f
    mlp = h * up + c.bias * up + f * h + c.bias * h
    emb = v * h + (c.max_positions * h if c.positions == "learned" else 0)
    return emb + c.layers * (2 * norm + attn + mlp) + norm + (0 if c.tied else h * v)


@pytest.mark.parametrize("over", [
    {}, {"tied": True, "qkv_bias": True}, {"bias": True}, {"norm": "layernorm", "mlp": "gelu", "positions": "learned",
                                                          "max_positions": 40, "kv_heads": 8, "head_dim": 12}])
def test_parameters_closed_form(over):
    c = _cfg(**over)
    assert build_transformer(c).parameters() == _closed_form(c)
    assert build_transformer(_cfg("gpt", **over)).parameters() == _closed_form(_cfg("gpt", **over))


def test_residual_graph_structure():
    g = build_transformer(_cfg())
    names = [l.name for l in g.layers]
    assert names == ["embedding", "ln1", "qkv", "attention", "proj", "residual", "ln2", "fc1", "swiglu", "fc2",
                     "ln_f", "logits", "loss"]
    r, emb = names.index("residual"), 0
    block = [names[i] for i in g.chain[1:11]]
    assert block == ["ln1", "qkv", "attention", "proj", "residual", "ln2", "fc1", "swiglu", "fc2", "residual"]
    assert g.counts()[r] == 2 * 3 and g.skips == [(emb, r)]
    assert g.blocks == [(1, 11), (11, 21), (21, 31)] and g.chain[31:] == [10, 11, 12]
    e = g.edges()
    assert e[(emb, r)] == 1 and e[(emb, 1)] == 1 and e[(r, 1)] == 2 and e[(r, 10)] == 1 and (r, r) not in e
    att = g.layers[3].all_dims()
    assert att == {"tokens": 32, "hidden": 64, "heads": 8, "kv_heads": 2, "head_dim": 8, "micro_batch": 2,
                   "flash": 1, "rotary": 1, "autocast": 1, "qkv_fused": 0}
    assert g.layers[2].dim("n") == (8 + 2 * 2) * 8  # fused QKV: heads + 2 kv_heads of head_dim
    assert g.layers[7].dim("n") == 2 * 96 and g.layers[8].all_dims() == {"tokens": 32, "hidden": 96, "autocast": 1}
    assert g.layers[1].kind == "rmsnorm" and g.layers[0].dim("positions") == 0


def test_gpt_graph_has_learned_positions_biases_and_tied_logits():
    g = load_model("gpt", "gpt2")
    by = {l.name: l for l in g.layers}
    assert by["embedding"].dim("positions") == 1024 and by["logits"].dim("tied") == 1
    assert by["qkv"].dim("bias") == 1 and by["ln1"].all_dims() == {"tokens": 16 * 1024, "hidden": 768, "bias": 1,
                                                                                   "autocast": 1}
    assert by["gelu"].kind == "pointwise" and by["attention"].dim("flash") == 1
    untied = load_model("gpt", "gpt2", {"tied": False})
    assert untied.parameters() - g.parameters() == 768 * 50257


def test_head_dim_apart_from_hidden():
    g = build_transformer(_cfg(hidden=60, heads=8, kv_heads=4, head_dim=16))
    qkv, att, proj = g.layers[2], g.layers[3], g.layers[4]
    assert qkv.dim("n") == 16 * 16 and att.dim("hidden") == 128 and (proj.dim("k"), proj.dim("n")) == (128, 60)


def test_no_residual_keeps_the_layer_dims_sparse():
    g = build_transformer(_cfg("gpt", residual=False, attention="naive", tied=False, bias=False, positions="none",
                               kv_heads=8))
    att = g.layers[3]
    assert dict(att.dims) == {"tokens": 32, "hidden": 64, "heads": 8, "micro_batch": 2}
    assert att.dim("kv_heads") == 8 and att.dim("head_dim") == 8 and att.dim("flash") == 0
    assert g.layers[1].dim("bias") == 1  # AutoDDL's LayerNorm keeps its shift


def test_config_round_trips_through_a_model_file(tmp_path):
    g = load_model("llama", "qwen2.5-7b", {"layers": 2})
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"kind": "llama", **g.config}))
    h = load_model(str(f))
    assert h.layers == g.layers and h.chain == g.chain and h.config == g.config


def test_a_folder_named_like_a_kind_is_not_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt").mkdir()
    assert load_model("gpt").model == "gpt"
    with pytest.raises(UserError, match="does not exist"):
        load_model("sub/gpt")


@pytest.mark.parametrize("kind,over,msg", [
    ("llama", {"heads": 8, "kv_heads": 3}, "'kv_heads' is 3, which does not divide heads 8"),
    ("gpt", {"hidden": 66, "heads": 8}, "hidden 66 is not a multiple of heads 8; .*give head_dim"),
    ("llama", {"ffn": None}, "missing field 'ffn'"),
    ("gpt", {"layers": 0}, "field 'layers' is 0; it must be a positive integer"),
    ("gpt", {"hidden": -64}, "field 'hidden' is -64"),
    ("llama", {"ffn": 5461.33}, "field 'ffn' is 5461.33; it must be a positive integer"),
    ("llama", {"ffn": "5461"}, "field 'ffn' is '5461'"),
    ("gpt", {"attention": "foo"}, "field 'attention' is 'foo'; it must be one of flash, naive"),
    ("gpt", {"tied": 1}, "field 'tied' is 1; it must be true or false"),
    ("gpt", {"heads": True}, "field 'heads' is True; it must be a positive integer"),
    ("gpt", {"batch": 10, "micro_batch": 4}, "batch 10 is not a multiple of micro_batch 4"),
    ("gpt", {"act_bytes": 3}, "act_bytes 3 must be 2"),
    ("gpt", {"max_positions": 8}, "'max_positions' is 8, fewer rows than sequence 16"),
    ("gpt", {"dropout": 0.1}, "unknown field 'dropout'"),
    ("bert", {}, "unknown transformer kind 'bert'"),
])
def test_bad_fields(kind, over, msg):
    cfg = {"layers": 3, "hidden": 64, "heads": 8, "ffn": 96, "sequence": 16, "vocabulary": 100, "batch": 8,
           "micro_batch": 2, **over}
    with pytest.raises(UserError, match=msg) as e:
        TransformerConfig.from_fields(kind, {k: v for k, v in cfg.items() if v is not None}, "test")
    assert "\n" not in str(e.value)


def test_bad_model_file_fields_fail_before_building(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"kind": "llama", "layers": 2, "hidden": 64, "heads": 8, "kv_heads": 3, "ffn": 96,
                             "sequence": 16, "vocabulary": 100, "batch": 8, "micro_batch": 2}))
    with pytest.raises(UserError, match=r"model file .*m\.json.*'kv_heads' is 3"):
        load_model(str(f))
    with pytest.raises(UserError, match="llama preset 'llama3-8b': field 'mlp' is 'relu'"):
        load_model("llama", None, {"mlp": "relu"})


@pytest.mark.parametrize("field, value", [("layers", 100_000_000), ("batch", 2**62), ("sequence", 2**30)])
def test_work_beyond_the_limits_is_refused_before_building(field, value):
    cfg = {"layers": 2, "hidden": 64, "heads": 4, "sequence": 16, "vocabulary": 128, "batch": 4, "micro_batch": 4,
           field: value}
    if field == "batch":
        cfg["micro_batch"] = 2**62
    with pytest.raises(UserError, match=f"field '{field}' is .* above the"):
        load_model("gpt", None, cfg)
