"""Every model field is a flag of the search command, typed as models.FIELDS says; bad values are one line."""
import pytest

from autotune.__main__ import main as autotune_main
from autotune.cli.search import parser
from models import FIELDS, load_model


def overrides(argv):
    args = parser().parse_args(argv)
    return {k[2:]: v for k, v in vars(args).items() if k.startswith("f_") and v is not None}


def test_every_field_has_a_flag_with_help():
    actions = {a.dest: a for a in parser()._actions}
    for fields in FIELDS.values():
        for name in fields:
            assert actions[f"f_{name}"].help


def test_typed_flags_reach_the_graph():
    over = overrides(["--kv-heads", "7", "--attention", "naive", "--tied", "true", "--qkv-bias", "False",
                      "--layers", "2", "--ffn", "1024"])
    assert over == {"kv_heads": 7, "attention": "naive", "tied": True, "qkv_bias": False, "layers": 2, "ffn": 1024}
    g = load_model("llama", "qwen2.5-7b", over)
    by = {l.name: l for l in g.layers}
    assert by["attention"].dim("kv_heads") == 7 and by["attention"].dim("flash") == 0
    assert by["logits"].dim("tied") == 1 and by["qkv"].dim("bias") == 0 and g.counts()[5] == 4
    assert overrides(["--dims", "8,4,2"]) == {"dims": [8, 4, 2]}


@pytest.mark.parametrize("argv", [["--tied", "1"], ["--attention", "foo"], ["--norm", "batchnorm"]])
def test_bad_flag_values_stop_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()[-1]) > 0


def test_bad_field_is_one_line_before_the_search(capsys, tmp_path):
    rc = autotune_main(["--model", "llama", "--kv-heads", "5", "--profile", "gcp-a100", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "'kv_heads' is 5, which does not divide heads 32" in err[0]
    assert not (tmp_path / "plan.json").exists()
