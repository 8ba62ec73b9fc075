"""The CLI end to end on a small case, plan round trip, and one-line errors."""
import json
import subprocess
import sys

import pytest

from autotune.__main__ import main as autotune_main
from autotune.plan.file import PlanFile

SMALL = ["--model", "gpt", "--preset", "gpt3-1.3b", "--layers", "2", "--nodes", "2", "--gpus-per-node", "2",
         "--profile", "gcp-a100", "--budget", "0.3", "--batch", "8", "--micro-batch", "8", "--sequence", "256",
         "--pipeline", "off"]  # the single-stage search (stages: tests/autotune/test_pipeline_cli.py)


def test_cli_writes_plan_and_report(tmp_path, capsys):
    assert autotune_main(SMALL + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for word in ("searched (cd)", "data parallel", "Megatron", "SUMMA 2D", "S/B only", "redistribution"):
        assert word in out
    pf = PlanFile.load(tmp_path / "plan.json")
    d = json.loads((tmp_path / "plan.json").read_text())
    assert PlanFile.from_dict(pf.to_dict()).to_dict() == d
    layer = d["best"]["layers"][1]
    assert len(layer["input"]) == 2 and layer["collectives"] is not None and d["best"]["apply_path"] == "dtensor"
    assert pf.best.costs.total_s <= min(b.costs.total_s for b in pf.baselines if b.costs.fits_memory) * 1.0000001
    html = (tmp_path / "report.html").read_text()
    assert "Search convergence" in html and "<svg" in html
    export = f"python -m autotune export {tmp_path / 'plan.json'} --to torchtitan|megatron"
    assert out.rstrip().endswith(f"torchrun --nnodes 2 --nproc-per-node 2 -m autotune execute {tmp_path / 'plan.json'}")
    assert export in out and f'model = autotune.apply("{tmp_path / "plan.json"}", model)' in out and "Next steps" in html and export in html


@pytest.mark.parametrize("args,msg", [
    (["--model", "bert"], "unknown model 'bert'"),
    (["--model", "gpt", "--preset", "gpt5"], "unknown preset 'gpt5'"),
    (["--memory-limit", "0.001"], "smallest needs"),
    (["--profile", "piz-daint"], "no intra tier"),
    (["--nodes", "3"], "do not divide"),
])
def test_bad_input_is_one_line(args, msg, capsys):
    base = [a for a in SMALL]
    rc = autotune_main(base + args + ["--out", "/tmp/unused-autotune-out"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert msg in err[-1] and err[-1].startswith("autotune: error:")


def test_bad_model_file(tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"kind": "gpt", "layers": 2, "hidden": 100, "heads": 3}))
    assert autotune_main(["--model", str(f), "--profile", "gcp-a100"]) == 2
    assert "missing field" in capsys.readouterr().err


def test_default_run_names_the_default_profile(tmp_path):
    from calibrate.profile import DEFAULT_PROFILE, embedded_profile_names
    r = subprocess.run([sys.executable, "-m", "autotune", "--model", "gpt", "--budget", "0.2", "--compare", "none",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    if DEFAULT_PROFILE in embedded_profile_names():
        assert r.returncode == 0, r.stderr
        assert "default cluster" in r.stdout and "default profile" in r.stdout
        assert (tmp_path / "plan.json").is_file()
    else:
        assert r.returncode == 2 and DEFAULT_PROFILE in r.stderr


def test_a_second_search_into_a_locked_out_is_refused(tmp_path):
    """Two searches into one --out: the second finds the first's lock and stops before any work."""
    from calibrate.lock import DirLock
    out = tmp_path / "out"
    with DirLock(out, "search output directory"):
        r = subprocess.run([sys.executable, "-m", "autotune", "--model", "mlp", "--nodes", "1", "--gpus-per-node", "2",
                            "--compare", "none", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is in use by process" in r.stderr and "Traceback" not in r.stderr
    assert not (out / "plan.json").exists()


def test_graph_note_names_autoddls_graph():
    """Size flags on the gpt kind's default preset keep AutoDDL's graph: the model line says so and how to get a
    transformer as users write it; a user's GPT gets no note."""
    from autotune.cli.search import graph_note
    from models.loader import load_model
    note = graph_note(load_model("gpt", None, {"layers": 2}).config)
    assert "attention naive" in note and "no residual stream" in note and "--preset gpt2" in note
    assert graph_note(load_model("gpt", "gpt2").config) == "" == graph_note(load_model("llama", "llama3-8b").config)
