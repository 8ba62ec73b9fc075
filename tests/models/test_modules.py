"""The reference nn.Modules of the transformer family (models.modules): shapes, parameter counts
(a closed form, and the layer graph's count once it knows the family), one Linear per projection
the layer graph prices, the Llama against Hugging Face's with the same weights, the fused
(head-grouped QKV, interleaved SwiGLU) and separate projections computing the same function, flash against naive
attention, causality, and recomputation's gradients against none."""
import pytest

torch = pytest.importorskip("torch")

from calibrate.errors import OptionError, UserError  # noqa: E402
from models import load_model  # noqa: E402
from models.transformer import build as build_graph  # noqa: E402
from models.modules import build, family_config  # noqa: E402

GPT = dict(kind="gpt", layers=2, hidden=16, heads=4, sequence=8, vocabulary=32, batch=4, micro_batch=2)
LLAMA = dict(kind="llama", layers=2, hidden=16, heads=4, kv_heads=2, ffn=24, sequence=8, vocabulary=32, batch=4,
             micro_batch=2)
AUTODDL = dict(GPT, attention="naive", residual=False, tied=False, bias=False)
QWEN = dict(LLAMA, qkv_bias=True, tied=True)
CONFIGS = {"gpt": GPT, "llama": LLAMA, "autoddl": AUTODDL, "qwen2": QWEN}


def closed_form(cfg) -> int:
    c = family_config(cfg)
    h, hd, heads, kv, ffn, v = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"], c["ffn"], c["vocabulary"]
    norm = h * (2 if c["norm"] == "layernorm" and (c["bias"] or not c["residual"]) else 1)
    qkv = h * (heads + 2 * kv) * hd + c["qkv_bias"] * (heads + 2 * kv) * hd
    proj = heads * hd * h + c["bias"] * h
    up = 2 * ffn if c["mlp"] == "swiglu" else ffn
    mlp = h * up + c["bias"] * up + ffn * h + c["bias"] * h
    embed = v * h + (c["max_positions"] * h if c["positions"] == "learned" else 0)
    return embed + c["layers"] * (2 * norm + qkv + proj + mlp) + norm + (0 if c["tied"] else h * v)


def count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight once


def ids(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg["vocabulary"], (cfg["micro_batch"], cfg["sequence"]), generator=g)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shapes_and_closed_form_count(name):
    cfg = CONFIGS[name]
    model = build(cfg).double()
    x = ids(cfg)
    assert model(x).shape == (cfg["micro_batch"], cfg["sequence"], cfg["vocabulary"])
    loss = model(x, ids(cfg, 1))
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert count(model) == closed_form(cfg)


TINY = dict(layers=2, hidden=32, heads=4, sequence=8, vocabulary=64, batch=4, micro_batch=2, max_positions=8)


@pytest.mark.parametrize("kind,preset,extra", [
    ("gpt", "gpt2", {}), ("gpt", "autoddl-gcp-small", {}), ("gpt", "gpt3-1.3b", {}),
    ("llama", "llama3-8b", {"kv_heads": 2, "ffn": 48, "head_dim": 8}), ("llama", "mistral-7b", {"kv_heads": 2, "ffn": 48, "head_dim": 8}),
    ("llama", "qwen2.5-7b", {"kv_heads": 2, "ffn": 48, "head_dim": 8}),
])
def test_count_matches_the_layer_graph(kind, preset, extra):
    graph = load_model(kind, preset, {**TINY, **extra})
    cfg = dict(graph.config, kind=graph.model)
    assert count(build(cfg)) == graph.parameters()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_count_matches_the_layer_graph_of_the_config(name):
    cfg = CONFIGS[name]
    graph = build_graph(cfg["kind"], {k: v for k, v in cfg.items() if k != "kind"})
    assert count(build(cfg)) == graph.parameters()


def test_module_names_mirror_the_plan_layers():
    names = {n for n, _ in build(LLAMA).named_modules()}
    for n in ("embedding", "ln_f", "logits", "loss", "blocks.1.ln1", "blocks.1.q_proj", "blocks.1.k_proj",
              "blocks.1.v_proj", "blocks.1.attention", "blocks.1.proj", "blocks.1.residual", "blocks.1.ln2",
              "blocks.1.gate_proj", "blocks.1.up_proj", "blocks.1.swiglu", "blocks.1.fc2"):
        assert n in names
    assert not {"blocks.1.qkv", "blocks.1.fc1"} & names
    gpt = {n for n, _ in build(GPT).named_modules()}
    assert {"positions", "blocks.0.gelu", "blocks.0.qkv", "blocks.0.fc1"} <= gpt and "blocks.0.q_proj" not in gpt
    assert "blocks.0.residual" not in {n for n, _ in build(AUTODDL).named_modules()}


@pytest.mark.parametrize("cfg,qkv,fc1", [
    (LLAMA, 3, 2), (GPT, 1, 1), (AUTODDL, 1, 1), (dict(GPT, mlp="swiglu", ffn=24), 1, 2),
    (dict(LLAMA, residual=False), 1, 1)])
def test_projections_as_the_graph_prices_them(cfg, qkv, fc1):
    """One Linear per projection the layer graph prices (its ``projections`` dim), each of the graph's width."""
    graph = build_graph(cfg["kind"], {k: v for k, v in cfg.items() if k != "kind"})
    model = build(cfg)
    mapping = model.plan_mapping
    names = dict(model.named_modules())
    for layer in ("qkv", "fc1"):
        dims = next(lay for lay in graph.layers if lay.name == layer).all_dims()
        pats = mapping[layer] if isinstance(mapping[layer], list) else [mapping[layer]]
        mods = [names[p.replace("*", "0")] for p in pats]
        assert len(mods) == dims["projections"] == {"qkv": qkv, "fc1": fc1}[layer]
        assert sum(m.out_features for m in mods) == dims["n"] and {m.in_features for m in mods} == {dims["k"]}


def test_tied_logits_share_the_embedding():
    gpt, llama = build(GPT), build(LLAMA)
    assert gpt.logits.weight is gpt.embedding.weight
    assert llama.logits.weight is not llama.embedding.weight


def test_flash_and_naive_attention_agree():
    flash, naive = build(LLAMA).double(), build(dict(LLAMA, attention="naive")).double()
    x = ids(LLAMA)
    torch.testing.assert_close(flash(x), naive(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["gpt", "llama", "autoddl"])
def test_causal(name):
    cfg = CONFIGS[name]
    model = build(cfg).double()
    x = ids(cfg)
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % cfg["vocabulary"]
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :-1], b[:, :-1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, -1], b[:, -1])


def hf_llama(model, cfg):
    """Hugging Face's LlamaForCausalLM with the reference module's weights (the same names, one to one)."""
    transformers = pytest.importorskip("transformers")
    c = family_config(cfg)
    hd, heads, kv = c["head_dim"], c["heads"], c["kv_heads"]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c["vocabulary"], hidden_size=c["hidden"], intermediate_size=c["ffn"], num_hidden_layers=c["layers"],
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=c["max_positions"],
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False)).double()
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(model.embedding.weight)
        hf.lm_head.weight.copy_(model.logits.weight)
        hf.model.norm.weight.copy_(model.ln_f.weight)
        for mine, theirs in zip(model.blocks, hf.model.layers):
            for p in ("q_proj", "k_proj", "v_proj"):
                getattr(theirs.self_attn, p).weight.copy_(getattr(mine, p).weight)
            theirs.self_attn.o_proj.weight.copy_(mine.proj.weight)
            theirs.mlp.gate_proj.weight.copy_(mine.gate_proj.weight)
            theirs.mlp.up_proj.weight.copy_(mine.up_proj.weight)
            theirs.mlp.down_proj.weight.copy_(mine.fc2.weight)
            theirs.input_layernorm.weight.copy_(mine.ln1.weight)
            theirs.post_attention_layernorm.weight.copy_(mine.ln2.weight)
    return hf


def test_llama_matches_hugging_face():
    model = build(LLAMA, seed=3).double()
    with torch.no_grad():  # norms' scales away from one, so that a swapped norm shows
        for n, p in model.named_parameters():
            if "ln" in n:
                p.add_(0.1 * torch.randn_like(p))
    hf = hf_llama(model, LLAMA)
    x = ids(LLAMA)
    # Hugging Face computes the rotary angles in float32: agreement to ~1e-8, where a wrong layout is off by O(1)
    torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-6, atol=1e-6)


def grads(model, x, t):
    model.zero_grad(set_to_none=True)
    model(x, t).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_gives_identical_gradients(name, mode):
    cfg = CONFIGS[name]
    plain, recomputed = build(cfg).double(), build(cfg, recompute=mode).double()
    x, t = ids(cfg), ids(cfg, 1)
    want, got = grads(plain, x, t), grads(recomputed, x, t)
    assert want.keys() == got.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-13, atol=1e-15, msg=n)


def test_full_recomputation_reruns_each_block():
    model = build(GPT, recompute="full").double()
    calls = []
    model.blocks[0].qkv.register_forward_hook(lambda *a: calls.append(1))
    model(ids(GPT), ids(GPT, 1)).backward()
    assert len(calls) == 2  # once forward, once in the backward pass


def test_bad_config():
    with pytest.raises(UserError, match="ffn"):
        build({k: v for k, v in LLAMA.items() if k != "ffn"})
    with pytest.raises(UserError, match="kv_heads"):
        build(dict(LLAMA, kv_heads=3))
    with pytest.raises(UserError, match="norm"):
        build(dict(GPT, norm="batchnorm"))
    with pytest.raises(UserError, match="mlp"):
        build(dict(GPT, kind="mlp"))
    with pytest.raises(OptionError):
        build(GPT, recompute="some")


@pytest.mark.parametrize("rotary", [True, False])
def test_fused_and_separate_projections_agree(rotary):
    """The head-grouped fused QKV (k, v, then the group's queries) and interleaved [gate, up] give what separate
    q, k, v and gate, up give; a fused QKV laid out [q | k | v] does not."""
    from models.modules import Attention, SwiGLU
    hd, heads, kv, b, s = 4, 6, 2, 2, 5
    r = heads // kv
    att = Attention(hd, r, True, rotary, s).double()
    q, k, v = (torch.randn(b, s, n * hd, dtype=torch.float64) for n in (heads, kv, kv))
    grouped = torch.cat([torch.cat([k.unflatten(-1, (kv, hd))[:, :, g], v.unflatten(-1, (kv, hd))[:, :, g],
                                    q.unflatten(-1, (heads, hd))[:, :, g * r:(g + 1) * r].flatten(-2)], -1)
                         for g in range(kv)], -1)
    torch.testing.assert_close(att(grouped), att(q, k, v), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(att(torch.cat([q, k, v], -1)), att(q, k, v))
    gate, up = torch.randn(b, s, 7, dtype=torch.float64), torch.randn(b, s, 7, dtype=torch.float64)
    torch.testing.assert_close(SwiGLU()(torch.stack([gate, up], -1).flatten(-2)), SwiGLU()(gate, up))
