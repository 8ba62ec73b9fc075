"""Hugging Face config.json files as models, and the presets against transformers' own parameter counts."""
import pytest

from calibrate.errors import UserError
from models import load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# preset -> (config class, model class, its config's fields)
HF = {
    ("gpt", "gpt2"): ("GPT2", dict(n_embd=768, n_layer=12, n_head=12)),
    ("gpt", "gpt2-medium"): ("GPT2", dict(n_embd=1024, n_layer=24, n_head=16)),
    ("gpt", "gpt2-large"): ("GPT2", dict(n_embd=1280, n_layer=36, n_head=20)),
    ("gpt", "gpt2-xl"): ("GPT2", dict(n_embd=1600, n_layer=48, n_head=25)),
    ("llama", "llama3-8b"): ("Llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                           num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                           max_position_embeddings=8192)),
    ("llama", "llama3-70b"): ("Llama", dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                            num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                                            max_position_embeddings=8192)),
    ("llama", "llama3-405b"): ("Llama", dict(hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                                             num_key_value_heads=8, intermediate_size=53248, vocab_size=128256,
                                             max_position_embeddings=131072)),
    ("llama", "mistral-7b"): ("Mistral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                              num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
                                              max_position_embeddings=32768, sliding_window=4096)),
    ("llama", "qwen2.5-7b"): ("Qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                            num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                            max_position_embeddings=131072, tie_word_embeddings=False)),
    ("llama", "qwen2.5-72b"): ("Qwen2", dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                             num_key_value_heads=8, intermediate_size=29568, vocab_size=152064,
                                             max_position_embeddings=131072, tie_word_embeddings=False)),
}
MODEL = {"GPT2": "GPT2LMHeadModel", "Llama": "LlamaForCausalLM", "Mistral": "MistralForCausalLM",
         "Qwen2": "Qwen2ForCausalLM"}


def hf_config(family: str, **fields):
    return getattr(transformers, f"{family}Config")(architectures=[MODEL[family]], **fields)


def hf_parameters(config) -> int:
    """transformers' own count: the model built on the meta device (tied weights counted once)."""
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind,name", sorted(HF))
def test_presets_equal_transformers_count(kind, name, tmp_path):
    family, fields = HF[(kind, name)]
    config = hf_config(family, **fields)
    preset = load_model(kind, name)
    assert preset.parameters() == hf_parameters(config)
    config.to_json_file(tmp_path / "config.json")  # the same architecture read back from its config.json
    read = load_model(str(tmp_path / "config.json"), None, {"sequence": preset.config["sequence"],
                                                             "batch": preset.batch, "micro_batch": preset.micro_batch})
    assert read.layers == preset.layers and read.chain == preset.chain


@pytest.mark.parametrize("family,fields", [
    ("Llama", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                   intermediate_size=688, vocab_size=1000, tie_word_embeddings=True, head_dim=48)),
    ("Llama", dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                   vocab_size=1000, attention_bias=True, mlp_bias=True)),
    ("Qwen2", dict(hidden_size=192, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                   intermediate_size=512, vocab_size=500, tie_word_embeddings=True)),
    ("GPT2", dict(n_embd=128, n_layer=2, n_head=4, n_inner=300, vocab_size=700, n_positions=64)),
    ("GPT2", dict(n_embd=128, n_layer=2, n_head=4, vocab_size=700, n_positions=64, tie_word_embeddings=False)),
])
def test_config_json_counts_like_transformers(family, fields, tmp_path):
    config = hf_config(family, **fields)
    config.to_json_file(tmp_path / "config.json")
    g = load_model(str(tmp_path / "config.json"))
    assert g.parameters() == hf_parameters(config)
    assert (g.batch, g.micro_batch) == (64, 1)  # the README's defaults, for one device
    assert g.config["sequence"] == min(4096, fields.get("n_positions", config.max_position_embeddings))


def test_the_default_micro_batch_is_one_sequence_a_device(tmp_path):
    """A config.json leaves the micro-batch open: by default one sequence a device of the cluster (what a
    data-parallel plan needs), the largest divisor of the batch at most that, and the given one where it is given;
    the search's data-parallel baseline exists on 4 devices."""
    import json

    from autotune.cli.search import main
    hf_config("Llama", num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=512, vocab_size=512, max_position_embeddings=256).to_json_file(tmp_path / "c.json")
    path = str(tmp_path / "c.json")
    assert [load_model(path, None, {}, n).micro_batch for n in (1, 4, 6, 128)] == [1, 4, 4, 64]
    assert load_model(path, None, {"batch": 12}, 8).micro_batch == 6
    assert load_model(path, None, {"micro_batch": 2}, 4).micro_batch == 2
    assert main(["--model", path, "--nodes", "1", "--gpus-per-node", "4", "--budget", "0.2", "--compare", "none",
                 "--pipeline", "off", "--micro-batch", "4", "--out", str(tmp_path / "out")]) == 0
    plans = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plans["best"]["model"]["micro_batch"] == 4
    assert any(p["strategy"] == "data parallel" for p in plans["baselines"])


def test_model_type_without_architectures(tmp_path):
    transformers.MistralConfig(num_hidden_layers=2, sliding_window=None).to_json_file(tmp_path / "c.json")
    g = load_model(str(tmp_path / "c.json"), None, {"sequence": 8192})
    assert g.model == "llama" and g.layers[3].dim("kv_heads") == 8


@pytest.mark.parametrize("family,fields,over,msg", [
    ("Mixtral", dict(num_hidden_layers=2), {}, "architecture MixtralForCausalLM is not supported; supported: "
                                               "GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
    ("Mistral", dict(num_hidden_layers=2, sliding_window=4096), {"sequence": 8192},
     "sliding_window 4096 is shorter than sequence 8192.*at most 4096"),
    ("Llama", dict(num_hidden_layers=2, attention_bias=True), {}, "attention_bias true with mlp_bias false"),
    ("Llama", dict(num_hidden_layers=2, num_key_value_heads=5), {}, "'kv_heads' is 5, which does not divide heads 32"),
    ("Llama", dict(num_hidden_layers=2), {"micro_batch": 3}, "batch 64 is not a multiple of micro_batch 3"),
    ("Llama", dict(num_hidden_layers=2, max_position_embeddings=2048), {"sequence": 4096},
     "sequence 4096 is longer than the config's max_position_embeddings 2048.*at most 2048"),
    ("GPT2", dict(n_layer=2, n_positions=64), {"sequence": 65}, "longer than the config's n_positions 64"),
    ("Mixtral-as-Mistral", dict(num_hidden_layers=2), {},
     "num_local_experts, num_experts_per_tok describe a mixture of experts, which is not modelled"),
    ("Llama", dict(num_hidden_layers=2, hidden_act="weird"), {}, "hidden_act 'weird' is not modelled"),
    ("GPT2", dict(n_layer=2, activation_function="weird"), {}, "activation_function 'weird' is not modelled"),
])
def test_bad_hf_configs(family, fields, over, msg, tmp_path):
    arch = {"Mixtral": "MixtralForCausalLM", "Mixtral-as-Mistral": "MistralForCausalLM"}.get(family) or MODEL[family]
    getattr(transformers, f"{family.split('-')[0]}Config")(architectures=[arch], **fields).to_json_file(tmp_path / "config.json")
    with pytest.raises(UserError, match=msg):
        load_model(str(tmp_path / "config.json"), None, over)


def test_hf_config_with_a_preset_or_bad_values(tmp_path):
    f = tmp_path / "config.json"
    f.write_text('{"model_type": "llama", "hidden_size": 4096.5}')
    with pytest.raises(UserError, match="'hidden_size' is 4096.5; a Hugging Face config needs it as a positive integer"):
        load_model(str(f))
    with pytest.raises(UserError, match="preset applies to a model kind"):
        load_model(str(f), "llama3-8b")
    f.write_text('{"model_type": "llama", "hidden_size": 4096}')
    with pytest.raises(UserError, match="missing 'num_attention_heads'"):
        load_model(str(f))
    f.write_text('{"model_type": "bert"}')
    with pytest.raises(UserError, match="model_type 'bert' is not supported"):
        load_model(str(f))
