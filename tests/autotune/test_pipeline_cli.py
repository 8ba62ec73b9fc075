"""``python -m autotune`` with pipeline stages: the pipelined plan in plan.json and the table, and bad
input as one line before any work."""
import json

import pytest

from autotune.__main__ import main as autotune_main
from reports.html import Section
from reports.sections.pipeline import add

SMALL = ["--model", "gpt", "--preset", "gpt3-1.3b", "--layers", "4", "--hidden", "256", "--heads", "4",
         "--sequence", "128", "--vocabulary", "1024", "--batch", "16", "--micro-batch", "4", "--nodes", "2",
         "--gpus-per-node", "2", "--profile", "h200-nvlink+ib400", "--budget", "0.3", "--compare", "none"]


def test_pipeline_stages_in_plan_and_table(tmp_path, capsys):
    assert autotune_main(SMALL + ["--pipeline", "2", "--schedule", "eager-1f1b", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    from autotune.plan.file import PlanFile
    pf = PlanFile.load(tmp_path / "plan.json")
    plans = [pf.best] + pf.baselines
    piped = [p for p in plans if p.stages]
    assert any(p.strategy.startswith("pipelined (2 stages, eager-1f1b") for p in piped)
    assert any(p.strategy.startswith("Megatron 3-D") for p in piped)
    p = next(p for p in piped if p.strategy.startswith("pipelined"))
    assert [s.inflight for s in p.stages] == [min(p.micro_batches, 3), 1]  # eager: 2(p - i) - 1
    s0 = p.stages[0]
    assert s0.chain[0] == 0 and p.stages[1].chain[0] == s0.chain[1]
    assert s0.boundary_forward_s > 0 and s0.plan.layers and s0.timeline
    assert p.costs.step_s >= max(s.end_s for s in p.stages)
    assert "pipelined (2 stages" in out
    html = (tmp_path / "report.html").read_text()
    assert "<svg" in html and (("Pipeline stages" in html) == bool(pf.best.stages))
    sec = Section("pipeline")
    add(sec, p)
    body = "".join(sec.blocks)
    assert "Pipeline stages" in body and "<svg" in body and "stage 1" in body


NORMS = ("layernorm", "rmsnorm")


def test_pipelined_plan_holds_its_stages_plans_and_reports(tmp_path):
    from autotune.apply.place import one_stage
    from autotune.plan.file import PlanFile
    from calibrate.errors import UserError
    from reports.sections.sbp import build
    assert autotune_main(SMALL + ["--pipeline", "2", "--out", str(tmp_path)]) == 0
    pf = PlanFile.load(tmp_path / "plan.json")
    p = next(p for p in [pf.best] + pf.baselines if p.stages)
    names = [lay.name for lay in p.model.graph().layers]
    for s in p.stages:  # each stage's plan: a run of the model's layers on its submesh
        mine = [lay.name for lay in s.plan.layers]
        assert " ".join(mine) in " ".join(names) and s.plan.cluster == p.submesh
    with pytest.raises(UserError, match=r"the plan is pipelined \(2 stages\).*autotune.apply_pipeline\(plan, model\)"):
        one_stage(p)  # as autotune.apply reads a plan: pointed to apply_pipeline, not told of layers
    PlanFile(p, pf.baselines).save(tmp_path / "pipelined.json")  # the report of a pipelined best
    body = "".join(build([tmp_path / "pipelined.json"])[0].blocks)
    assert all(f"stage {i}: Per-layer plan" in body for i in range(len(p.stages))) and "Pipeline stages" in body


@pytest.mark.parametrize("args,msg", [
    (["--pipeline", "many"], "not auto, off or a stage count"),
    (["--pipeline", "5"], "5 stages for 4 blocks"),
    (["--pipeline", "3"], "do not divide the cluster"),
    (["--schedule", "zb"], "not a pipeline schedule"),
    (["--pipeline", "off", "--schedule", "gpipe"], "--schedule gpipe orders a pipeline's micro-batches, and --pipeline off"),
    (["--memory-limit", "1e308"], "--memory-limit 1e+308 GiB per device is out of range"),
    (["--pipeline", "4", "--batch", "1", "--micro-batch", "1"], "need at least 4 micro-batches for 1f1b, or 2"),
    (["--pipeline", "2", "--virtual-stages", "3"], "--virtual-stages 3 sets the chunks a rank of interleaved 1F1B"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "1"], "interleaved 1F1B runs at least 2 chunks a rank"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "0"], "--virtual-stages 0: interleaved 1F1B runs at least"),
    (["--pipeline", "4", "--schedule", "interleaved-1f1b"], "4 stages of 2 chunks need 8 blocks, the model has 4"),
])
def test_bad_pipeline_input_is_one_line(args, msg, capsys):
    assert autotune_main(SMALL + args + ["--out", "/tmp/unused-autotune-out"]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err and "--stages" not in err  # the flag is --pipeline


def test_fewer_micro_batches_than_stages_where_no_count_from_p_splits(tmp_path):
    """4 stages of one GPU and a batch of 2: no count from 4 divides it, 2 (from p / 2, splitting over the stage's
    one node) does: the stage search plans 2 micro-batches on 4 stages, stage i keeping min(p - i, m) in flight."""
    from autotune.pipeline.search import micro_batch_choices
    from models import load_model
    from autotune.sbp.mesh import Cluster
    g = load_model("gpt", "gpt3-1.3b", {"layers": 4, "hidden": 256, "heads": 4, "sequence": 128, "vocabulary": 1024,
                                        "batch": 48, "micro_batch": 4})
    # 12 splits over 4 nodes (first), then the others, the fewest first: none below 8
    assert micro_batch_choices(g, 8, Cluster(4, 1), 0) == [12, 8, 16, 24, 48]
    assert micro_batch_choices(g, 16, Cluster(4, 1), 0) == [12, 16, 24, 48]  # none from 16 splits: 12 (>= 8) added
    assert micro_batch_choices(g, 16, Cluster(4, 1), 2) == [12, 16]
    args = list(SMALL)
    args[args.index("--batch") + 1], args[args.index("--micro-batch") + 1] = "2", "1"
    assert autotune_main(args + ["--pipeline", "4", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "plan.json").read_text())
    p = next(p for p in [d["best"]] + d["baselines"] if p["strategy"].startswith("pipelined"))
    assert len(p["stages"]) == 4 and p["micro_batches"] == 2
    assert [s["inflight"] for s in p["stages"]] == [2, 2, 2, 1]


@pytest.mark.parametrize("effort", ["default", "full"])
def test_pipeline_effort_reaches_the_search(effort, tmp_path):
    """``--pipeline-effort full`` searches the stages at full effort (``PipelineConfig.full_effort``), the default
    at the command's capped effort; the plan records the settings it was searched with."""
    assert autotune_main(SMALL + ["--pipeline", "2", "--pipeline-effort", effort, "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "plan.json").read_text())
    cfg = next(p for p in [d["best"]] + d["baselines"] if p["strategy"].startswith("pipelined"))["search"]["config"]
    want = (None, 8, cfg["refine"]) if effort == "full" else (3, 2, 1)
    assert (cfg["patience"], cfg["relax_rounds"], cfg["split_dps"]) == want
