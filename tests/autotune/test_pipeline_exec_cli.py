"""``python -m autotune execute`` on a pipelined plan, 4 processes (gloo, float64): the reference GPT (tied
embedding and logits) cut into 4 stages of 1 device by the pipeline search's plan (1F1B; and interleaved 1F1B,
2 chunks a rank, of an 8-block GPT), trained through
``autotune.apply_pipeline``; the losses of the record equal the same module trained in one process on the
same micro-batches (AdamW), and --summarize tables it; a plan for another world and --layers
are one-line errors before any step."""
import json
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
import torch.distributed.tensor  # noqa: E402,F401  (imported once, before the workers fork)

from gloo_runner import run_on_gloo  # noqa: E402
from pipeline_exec_plans import GPT, searched  # noqa: E402
from tiny_models import module_path_one_process  # noqa: E402

STEPS, LR, SEED, RTOL = 2, 1e-2, 0, 1e-9
CFG = dict(GPT)



def one_process(config: dict, micro_batches: int) -> list[float]:
    """The execute module path's losses in one process (``tiny_models.module_path_one_process``)."""
    return module_path_one_process(config, micro_batches, STEPS, LR, SEED)[0]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    from autotune.plan.file import PlanFile
    path = tmp_path_factory.mktemp("pipe") / "plan.json"
    PlanFile(searched(CFG, 4), []).save(path)
    return path


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_execute_runs_a_pipelined_plan(plan_file, schedule, tmp_path):
    if schedule != "1f1b":  # 8 blocks: 2 chunks of one block on each of the 4 ranks
        from autotune.plan.file import PlanFile
        plan_file = tmp_path / "plan.json"
        PlanFile(searched(dict(CFG, layers=8), 4, schedule=schedule), []).save(plan_file)
    out = tmp_path / "exec"
    argv = [str(plan_file), "--steps", str(STEPS), "--warmup", "0", "--profile-steps", "0", "--dtype", "float64",
            "--device", "cpu", "--lr", str(LR), "--seed", str(SEED), "--out", str(out)]
    from autotune.execute.cli import main
    assert run_on_gloo(main, [(argv,)], init=False) == [[0]] * 4  # each rank's exit status
    rec = json.loads(next(out.glob("execute-*.json")).read_text())  # (summary.json beside it)
    plan = json.loads(plan_file.read_text())["best"]
    assert rec["executor"] == "pipeline" and rec["pipeline"]["split"] == plan["pipeline"]["split"]
    library = {"1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}[schedule]
    assert rec["pipeline"]["library_schedule"] == library and rec["world"] == 4
    assert rec["pipeline"]["paths"] == ["none"] * 4  # stages of one device: nothing to place
    assert rec["predicted"]["step_s"] == plan["costs"]["step_s"]
    want = one_process(plan["model"], plan["micro_batches"])
    assert rec["measured"]["losses"] == pytest.approx(want, rel=RTOL, abs=0)
    assert want[1] != pytest.approx(want[0])
    from autotune.execute.cli import summarize
    assert summarize(str(out)) == 0 and (out / "summary.md").exists()  # the table of a pipelined run


@pytest.mark.parametrize("extra,msg", [
    (["--layers", "2"], "a pipelined plan splits its model's blocks"),
    ([], "processes were launched"),
])
def test_bad_pipelined_execute_is_one_line(plan_file, extra, msg, tmp_path, capsys):
    from autotune.__main__ import main
    assert main(["execute", str(plan_file), "--out", str(tmp_path / "x")] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err
