"""Model presets, overrides, JSON files and their validation."""
import json

import pytest

from calibrate.errors import UserError
from models import load_model, model_kinds, presets


@pytest.mark.parametrize("preset,billions", [
    ("gpt3-1.3b", 1.3), ("gpt3-2.7b", 2.7), ("gpt3-6.7b", 6.7), ("gpt3-13b", 13), ("gpt3-175b", 175),
])
def test_gpt3_parameter_counts(preset, billions):
    # the logits matrix is counted apart from the embedding (untied), hence up to ~10% more than GPT-3
    assert load_model("gpt", preset).parameters() / 1e9 == pytest.approx(billions, rel=0.12)


def test_every_preset_builds():
    for kind in model_kinds():
        default, names = presets(kind)
        assert default in names
        for name in names:
            g = load_model(kind, name)
            assert g.chain and all(0 <= i < len(g.layers) for i in g.chain)


def test_gpt_ties_repeated_layers():
    g = load_model("gpt", "gpt3-175b")
    assert len(g.layers) == 12 and len(g.chain) == 1 + 96 * 8 + 3
    assert g.edges()[(8, 1)] == 95  # fc2 -> next block's ln1


def test_overrides_and_mlp_preset():
    g = load_model("gpt", None, {"layers": 3, "hidden": 256, "heads": 4})
    assert g.config["layers"] == 3 and g.counts()[1] == 3
    assert load_model("mlp").config["dims"] == [32768, 16384, 4096, 2048, 512]


def test_model_file(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"kind": "mlp", "dims": [8, 4, 2], "batch": 4, "micro_batch": 2}))
    g = load_model(str(f))
    assert g.micro_batches == 2 and [l.kind for l in g.layers] == ["matmul", "matmul", "loss"]  # two layers and the loss


@pytest.mark.parametrize("cfg,msg", [
    ({"kind": "mlp", "dims": [8], "batch": 4, "micro_batch": 2}, "list of at least two"),
    ({"kind": "mlp", "dims": [8, 4], "batch": 4, "micro_batch": 3}, "not a multiple of micro_batch"),
    ({"kind": "mlp", "dims": [8, 4], "batch": 4, "micro_batch": 2, "hidden": 3}, "unknown field 'hidden'"),
    ({"kind": "cnn"}, "unknown kind 'cnn'; use one of gpt, llama, mlp, u-transformer, vgg13"),
    ({"dims": [8, 4]}, "needs a \"kind\" field"),
])
def test_bad_model_files(tmp_path, cfg, msg):
    f = tmp_path / "m.json"
    f.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=msg):
        load_model(str(f))


def test_unknown_model_and_preset():
    with pytest.raises(UserError, match="unknown model"):
        load_model("resnet")
    with pytest.raises(UserError, match="unknown preset"):
        load_model("gpt", "gpt-4")


def test_blocks_cover_each_block_occurrence():
    g = load_model("u-transformer")
    assert len(g.blocks) == 5 * g.config["layers_per_stage"]
    for start, end in g.blocks:
        names = [g.layers[i].name.split(".")[-1] for i in g.chain[start:end]]
        assert names == ["ln1", "qkv", "attention", "proj", "ln2", "fc1", "gelu", "fc2"]
    assert load_model("mlp").blocks == [] and load_model("gpt").skips == []
