"""Broken records and out-of-range options given to every command that reads them, run in this
process through each package's ``main(argv)`` (test_bad_input.py runs its table as subprocesses;
a sample here does too, to prove the real entry points). Each case must exit non-zero with ONE
error line, last, naming the field (the expected pattern), no traceback, within ``CPU_LIMIT_S``
of CPU time, and change no file: the inputs keep their content and no output appears."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.cli.badrecords import (EXECUTE_CASES, PLAN_CASES, PROFILE_CASES, RESULTS_CASES, ROOT, SCHEDULE_CASES,
                                  broken_profile, digest, execute_record, make_results, run_main, schedule_record)

CPU_LIMIT_S = 10.0

# the commands that read a profile ({p}), a results directory ({r}) or a plan ({plan}); {out} must not appear
PROFILE_COMMANDS = {
    "calibrate-validate": "calibrate validate --profile {p} {res}",
    "calibrate-fit-compute-from": "calibrate fit {res} --compute-from {p} -o {out}/f.json",
    "calibrate-profiles-combine": "calibrate profiles --combine {p} ib400 -o {out}/c.json",
    "calibrate-profiles-combine-inter": "calibrate profiles --combine gcp-a100 {p} -o {out}/c.json",
    "autotune-search": "autotune --profile {p} --out {out}/s",
    "autotune-schedule": "autotune schedule --profile {p} --model-only --out {out}/s",
    "autotune-reshard": "autotune reshard --case 1 --profile {p} --plan-out {out}/p.json",
    "reports": "reports {p} -o {out}/r.html",
}
RESULTS_COMMANDS = {
    "calibrate-fit": "calibrate fit {r} -o {out}/f.json",
    "calibrate-validate": "calibrate validate --profile gcp-a100 {r}",
    "reports": "reports {r} -o {out}/r.html",
}
PLAN_COMMANDS = {
    "reports": "reports {plan} -o {out}/r.html",
    "autotune-export": "autotune export {plan} --to megatron --out {out}/m.sh",
}
SCHEDULE_COMMANDS = {
    "autotune-schedule-rescore": "autotune schedule --rescore {s}",
    "reports": "reports {s} -o {out}/r.html",
}
EXECUTE_COMMANDS = {
    "autotune-execute-summarize": "autotune execute --summarize {x}",
}
# options out of range or not finite, checked before any work
OPTION_CASES = [
    ("run-factor-nan", "calibrate run --backend mpi -f nan", "not a finite number"),
    ("run-factor-inf", "calibrate run --backend mpi -f inf", "not a finite number"),
    ("run-min-batch-nan", "calibrate run --backend mpi --min-batch-ms nan", "not a finite number"),
    ("run-min-batch-inf", "calibrate run --backend mpi --min-batch-ms inf", "not a finite number"),
    ("run-min-batch-huge", "calibrate run --backend mpi --min-batch-ms 1e9", "--min-batch-ms"),
    ("run-iters-billion", "calibrate run --backend mpi -n 1000000000", r"calls per size"),
    ("run-reps-million", "calibrate run --backend mpi --reps 1000000 -n 2", r"calls per size"),
    ("run-warmup-huge", "calibrate run --backend mpi -w 5000000", r"calls per size"),
    ("run-refine-budget-nan", "calibrate run --backend mpi --refine --refine-budget nan", "not a finite number"),
    ("run-refine-tol-inf", "calibrate run --backend mpi --refine --refine-tol inf", "not a finite number"),
    ("validate-random-min-batch-nan", "calibrate validate --random 4 --min-batch-ms nan", "not a finite number"),
    ("fit-link-peak-nan", "calibrate fit {res} --link-peak nan -o {out}/f.json", "not a finite number"),
    ("fit-link-peak-inf", "calibrate fit {res} --link-peak inf -o {out}/f.json", "not a finite number"),
    ("fit-link-peak-zero", "calibrate fit {res} --link-peak 0 -o {out}/f.json", "--link-peak"),
    ("compile-max-memory-nan", "kernels compile ring_allreduce --ranks 4 --max-memory nan -o {out}/x.xml",
     "not a finite number"),
    ("reshard-budget-nan", "autotune reshard --case 1 --time-budget nan", "not a finite number"),
    ("reshard-budget-inf", "autotune reshard --case 1 --time-budget inf", "not a finite number"),
    ("nccl-prune-nan", "autotune nccl --prune nan", "not a finite number"),
    ("nccl-margin-inf", "autotune nccl --margin inf", "not a finite number"),
    ("peers-margin-nan", "kernels peers --margin nan", "not a finite number"),
    ("explain-micro-batch-zero", "autotune explain summa gpt-small-gcp --micro-batch 0", "--micro-batch"),
    ("explain-micro-batch-negative", "autotune explain versus-data-parallel gpt-small-gcp --micro-batch -4",
     "--micro-batch"),
    ("explain-classes-zero", "autotune explain megatron-meshes vgg-gcp-2x4 --classes 0", "--classes"),
    ("reshard-mesh-huge", "autotune reshard --src-mesh 100000,100000 --src-spec S0RR --dst-mesh 2,4 --dst-spec RRR "
     "--shape 64,64,32", "over the planner's limit"),
    ("reshard-dst-mesh-huge", "autotune reshard --src-mesh 2,4 --src-spec S0RR --dst-mesh 2048,8 --dst-spec RRR "
     "--shape 64,64,32", "over the planner's limit"),
    ("execute-warmup-all-steps", "autotune execute {good_plan} --steps 3 --warmup 3", r"--warmup 3 leaves none"),
    ("execute-warmup-above-steps", "autotune execute {good_plan} --steps 2 --warmup 5", r"give --steps above"),
    ("execute-steps-zero", "autotune execute {good_plan} --steps 0", r"--steps must be at least 1"),
    ("execute-lr-nan", "autotune execute {good_plan} --lr nan", "--lr: 'nan' is not a finite number"),
    ("execute-lr-negative", "autotune execute {good_plan} --lr -1", r"--lr -1 is not a learning rate"),
    ("execute-tied-true", "autotune execute {good_plan} --tied true", "the plan's model has tied"),
    ("execute-attention-other", "autotune execute {good_plan} --attention flash", "the plan's model has attention"),
    ("execute-steps-billion", "autotune execute {good_plan} --steps 1000000000", "over the limit of 100,000 steps"),
    ("search-seed-negative", "autotune --seed -1 --out {out}/s", "--seed -1 is out of range"),
    ("search-seed-2-32", "autotune --seed 4294967296 --out {out}/s", "--seed 4294967296 is out of range"),
    ("search-budget-years", "autotune --budget 1e12 --out {out}/s", "over the limit of 86,400 s"),
    ("search-budget-steps-huge", "autotune --budget 99999999999steps --out {out}/s", "over the limit"),
    ("tp-mlp-hidden-zero", "kernels tp-mlp --hidden 0", "--hidden 0"),
    ("tp-mlp-ffn-negative", "kernels tp-mlp --ffn -8", "--ffn -8"),
    ("tp-mlp-tokens-zero", "kernels tp-mlp --tokens 8,0", "positive token counts"),
    ("tp-mlp-steps-zero", "kernels tp-mlp --steps 0", "--steps 0"),
    ("tp-mlp-out-devnull", "kernels tp-mlp --out /dev/null/x.json", "not a directory"),
    ("schedule-sizes-factor-zero", "autotune schedule --sizes 1K:1M:0", r"--sizes .*must be a number above 1"),
    ("schedule-sizes-factor-one", "autotune schedule --sizes 1K:1M:1", r"--sizes .*must be a number above 1"),
    ("reproduce-out-devnull", "autotune reproduce autoddl --out /dev/null/x", "not a directory"),
    ("run-resume-missing", "calibrate run --backend mpi -b 1K -e 2K --out {out}/never --resume",
     "one rank|nothing to continue"),
    # issue 44: NaN in the pipeline search, flags that did nothing, work before a limit, a path not UTF-8
    ("search-memory-limit-huge", "autotune --memory-limit 1e308 --out {out}/s", r"--memory-limit 1e\+308 GiB"),
    ("search-schedule-without-pipeline", "autotune --pipeline off --schedule gpipe --out {out}/s",
     "--schedule gpipe orders a pipeline's micro-batches, and --pipeline off searches none"),
    ("search-stages-misfit", "autotune --pipeline 3 --out {out}/s", r"^(?!.*--stages).*--pipeline 3 stages do not"),
    ("search-out-not-utf8", "autotune --out {out}/s\udcff", "has a byte that is not UTF-8"),
    ("export-out-not-utf8", "autotune export {good_plan} --to megatron --out {out}/m\udcff.sh", "not UTF-8"),
    ("reports-out-not-utf8", "reports {good_plan} -o {out}/r\udcff.html", "has a byte that is not UTF-8"),
    ("explain-papers-plan-case", "autotune explain papers-plan gpt-small-gcp", "remove the case 'gpt-small-gcp'"),
    ("explain-papers-plan-micro-batch", "autotune explain papers-plan --micro-batch 4", "remove --micro-batch"),
    ("reshard-tensor-huge", "autotune reshard --src-mesh 2,4 --src-spec S0RR --dst-mesh 2,4 --dst-spec RRR "
     "--shape 100000000000,100000000000,400000000000 --devices-per-host 4", r"4e\+33 elements, over the planner"),
    ("validate-seed-negative", "autotune validate --seed -1", "--seed: -1 is not a seed"),
    ("execute-seed-huge", "autotune execute {good_plan} --seed 4294967296", "--seed: 4294967296 is not a seed"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_records")
    res = make_results(root / "res")
    profile = json.loads((ROOT / "calibrate" / "profiles" / "gcp-a100.json").read_text())
    profiles = root / "profiles"
    profiles.mkdir()
    for name, mutate, _ in PROFILE_CASES:
        data = broken_profile(profile, mutate)
        path = profiles / f"{name}.json"
        (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    results = root / "results"
    results.mkdir()
    for name, mutate, _ in RESULTS_CASES:
        shutil.copytree(res, results / name)
        mutate(results / name)
    plan_dir = root / "plan"
    rc, out, _, tb = run_main(["autotune", "--profile", "gcp-a100", "--out", str(plan_dir)])
    assert rc == 0 and not tb, out + tb
    plan = json.loads((plan_dir / "plan.json").read_text())
    plans = root / "plans"
    plans.mkdir()
    for name, mutate, _ in PLAN_CASES:
        data = broken_profile(plan, mutate)
        path = plans / f"{name}.json"
        (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    for name, mutate, _ in EXECUTE_CASES:
        folder = root / "executed" / name
        folder.mkdir(parents=True)
        for i, (strategy, step) in enumerate((("searched", 0.1), ("data parallel", 0.2), ("Megatron", 0.3))):
            data = broken_profile(execute_record(strategy, step), mutate) if i == 1 else \
                json.dumps(execute_record(strategy, step))
            path = folder / f"execute-{i:02d}-x.json"
            (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    (root / "schedules").mkdir()
    (root / "schedules" / "good.json").write_text(json.dumps(schedule_record()))
    for name, mutate, _ in SCHEDULE_CASES:
        data = broken_profile(schedule_record(), mutate)
        (root / "schedules" / f"{name}.json").write_text(data)
    good = root / "executed" / "good"
    good.mkdir()
    for i, (strategy, step) in enumerate((("searched", 0.1), ("data parallel", 0.2))):
        (good / f"execute-{i:02d}-x.json").write_text(json.dumps(execute_record(strategy, step)))
    return root


def _cases():
    for name, _, expect in PROFILE_CASES:
        for cmd, line in PROFILE_COMMANDS.items():
            yield pytest.param(line, {"p": f"profiles/{name}.json"}, expect, id=f"profile-{name}-{cmd}")
    for name, _, expect in RESULTS_CASES:
        for cmd, line in RESULTS_COMMANDS.items():
            yield pytest.param(line, {"r": f"results/{name}"}, expect, id=f"results-{name}-{cmd}")
    for name, _, expect in PLAN_CASES:
        for cmd, line in PLAN_COMMANDS.items():
            yield pytest.param(line, {"plan": f"plans/{name}.json"}, expect, id=f"plan-{name}-{cmd}")
    for name, _, expect in EXECUTE_CASES:
        for cmd, line in EXECUTE_COMMANDS.items():
            yield pytest.param(line, {"x": f"executed/{name}"}, expect, id=f"execute-{name}-{cmd}")
    for name, _, expect in SCHEDULE_CASES:
        for cmd, line in SCHEDULE_COMMANDS.items():
            yield pytest.param(line, {"s": f"schedules/{name}.json"}, expect, id=f"schedule-{name}-{cmd}")
    for name, line, expect in OPTION_CASES:
        yield pytest.param(line, {}, expect, id=f"option-{name}")


CASES = list(_cases())


def test_the_suite_is_big():
    assert len(CASES) >= 300


def test_the_good_records_are_accepted(inputs, tmp_path):
    """The records the cases break, unbroken, pass the same commands (a case fails for its break)."""
    for argv in (["calibrate", "validate", "--profile", "gcp-a100", str(inputs / "res")],
                 ["reports", str(inputs / "res"), str(inputs / "plan" / "plan.json"), "-o", str(tmp_path / "r.html")],
                 ["autotune", "execute", "--summarize", str(inputs / "executed" / "good")],
                 ["autotune", "schedule", "--rescore", str(inputs / "schedules" / "good.json")],
                 ["reports", str(inputs / "schedules" / "good.json"), "-o", str(tmp_path / "s.html")]):
        rc, out, _, tb = run_main(argv)
        assert rc == 0 and not tb, out[-800:] + tb


def check_outcome(rc: int, out: str, expect: str, cpu_s: float, tb: str) -> None:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    shown = "\n".join(lines[-6:])
    assert not tb, f"traceback:\n{tb}"
    assert rc not in (0, None), f"accepted (exit {rc}):\n{shown}"
    assert not any("Traceback" in ln for ln in lines), f"traceback:\n{shown}"
    assert cpu_s <= CPU_LIMIT_S, f"took {cpu_s:.1f} s of CPU time before the error"
    errors = [ln for ln in lines if "error" in ln.lower()]
    assert len(errors) == 1, f"{len(errors)} error lines instead of one:\n{shown}"
    assert lines[-1] == errors[0], f"the error is not the last line:\n{shown}"
    assert re.search(expect, errors[0], flags=re.IGNORECASE), f"does not name the problem ({expect}): {errors[0]}"


@pytest.mark.parametrize("line, files, expect", CASES)
def test_bad_record(line, files, expect, inputs, tmp_path):
    subst = {"res": str(inputs / "res"), "out": str(tmp_path / "out"), "good_plan": str(inputs / "plan" / "plan.json"),
             **{k: str(inputs / v) for k, v in files.items()}}
    argv = [a.format(**subst) for a in line.split()]
    watched = [inputs / v for v in files.values()] + [inputs / "res"]
    before = {str(p): digest(p) if p.is_dir() else p.read_bytes() for p in watched}
    rc, out, cpu_s, tb = run_main(argv)
    check_outcome(rc, out, expect, cpu_s, tb)
    after = {str(p): digest(p) if p.is_dir() else p.read_bytes() for p in watched}
    assert before == after, "an input changed"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*")), "an output was written"


# ---- a sample through the real entry points ----------------------------------------------------------
SUBPROCESS_SAMPLE = ["profile-alpha-nan-autotune-search", "profile-fit-last-zero-calibrate-validate",
                     "results-stats-binary-calibrate-fit", "plan-layer-input-long-reports", "option-run-factor-nan"]


@pytest.mark.parametrize("case_id", SUBPROCESS_SAMPLE)
def test_sample_as_subprocess(case_id, inputs, tmp_path):
    line, files, expect = next(c.values for c in CASES if c.id == case_id)
    subst = {"res": str(inputs / "res"), "out": str(tmp_path / "out"),
             **{k: str(inputs / v) for k, v in files.items()}}
    argv = [a.format(**subst) for a in line.split()]
    r = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    check_outcome(r.returncode, r.stdout + r.stderr, expect, 0.0, "")
    assert not (tmp_path / "out").exists()


def test_help_into_a_closed_pipe_is_quiet():
    """``--help | head``: the reader has gone before the help is written (a pipe whose read end is
    closed); the command ends without a BrokenPipeError traceback."""
    for argv in (["autotune", "--help"], ["calibrate", "--help"], ["autotune", "schedule", "--help"], ["calibrate", "run", "--help"],
                 ["reports", "--help"]):
        read, write = os.pipe()
        os.close(read)
        try:
            r = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, stdout=write, stderr=subprocess.PIPE,
                               text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        finally:
            os.close(write)
        assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_export_checks_its_out_before_printing(inputs, tmp_path):
    """``autotune export --out`` naming a folder is refused before the config is printed (it was
    printed whole, then refused)."""
    rc, out, cpu_s, tb = run_main(["autotune", "export", str(inputs / "plan" / "plan.json"), "--to", "torchtitan",
                                   "--out", str(tmp_path)])
    check_outcome(rc, out, "is a directory", cpu_s, tb)
    assert len([ln for ln in out.splitlines() if ln.strip()]) == 1, out


def test_a_models_package_in_the_working_folder_is_named(tmp_path):
    """``python -m autotune`` run inside a training repository with its own ``models/`` package (first
    on the import path): one line naming the package and the console script, no ImportError traceback."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "net.py").write_text("class Net:\n    pass\n")
    for argv in (["autotune", "--model", "gpt", "--out", "gpt"], ["autotune", "execute", "plan.json"]):
        r = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        check_outcome(r.returncode, r.stdout + r.stderr, "the package 'models' in .* hides this project's own "
                      "'models'.*commtune-autotune", 0.0, "")
        assert not (tmp_path / "gpt").exists()


def test_summarize_checks_its_outputs_before_the_tables(inputs, tmp_path):
    """``execute --summarize DIR`` where DIR/summary.json cannot be written (a folder of that name) is
    refused before the tables are printed and before breakdown.txt is written (both happened first)."""
    folder = tmp_path / "executed"
    folder.mkdir()
    for record in (inputs / "executed" / "good").glob("execute-*.json"):  # not what an earlier --summarize wrote
        shutil.copy(record, folder)
    (folder / "summary.json").mkdir()
    rc, out, cpu_s, tb = run_main(["autotune", "execute", "--summarize", str(folder)])
    check_outcome(rc, out, "summary.json' is a directory", cpu_s, tb)
    assert len([ln for ln in out.splitlines() if ln.strip()]) == 1, out
    assert sorted(p.name for p in folder.iterdir()) == ["execute-00-x.json", "execute-01-x.json", "summary.json"]


# ---- records the report reads beside plans and profiles: execute summary, resharding results, reproduction --
SECTION_CASES = [
    # (record, edit of the parsed good record, what the error names)
    ("summary", lambda d: d.pop("cluster"), "cluster is missing"),
    ("summary", lambda d: d.update(cluster="x"), "cluster is 'x', not an object"),
    ("summary", lambda d: d.pop("device"), "device is missing"),
    ("summary", lambda d: d.update(backend=5), "backend is 5, not a string"),
    ("summary", lambda d: d["cluster"].update(nodes=0), "cluster/nodes is 0"),
    ("summary", lambda d: d.update(rows="x"), "rows is 'x', not a list"),
    ("summary", lambda d: d["rows"][0].update(step_s=math.nan), "rows/0/step_s is nan"),
    ("summary", lambda d: d["rows"][0].pop("strategy"), "rows/0/strategy is missing"),
    ("summary", lambda d: d["rows"][0].update(pred_memory_bytes=-1), "rows/0/pred_memory_bytes"),
    ("summary", lambda d: d.update(targets=[]), "targets is \\[\\], not an object"),
    ("summary", lambda d: d.update(failed={"x": 1}), "failed is"),
    ("reshard", lambda d: d.update(cases={"x": 1}), "cases is"),
    ("reshard", lambda d: d["cases"][0].pop("times"), "cases/0/times is missing"),
    ("reshard", lambda d: d["cases"][0].update(lower_bound="x"), "cases/0/lower_bound"),
    ("reshard", lambda d: d["cases"][0]["task"].pop("src_mesh"), "cases/0/task/src_mesh is missing"),
    ("reshard", lambda d: d["cases"][0]["chosen"].update(makespan=math.inf), "cases/0/chosen/makespan is inf"),
    ("reshard", lambda d: d.update(pipelines=[{"name": "p"}]), "pipelines/0/schedules is missing"),
    ("reshard", lambda d: d.update(executed=[{"measured_s": "1"}]), "executed/0/measured_s"),
    ("reshard", lambda d: d.update(profile=3), "profile is 3, not a string"),
    ("reproduction", lambda d: d.pop("rows"), "rows is missing"),
    ("reproduction", lambda d: d.update(rows={"a": 1}), "rows is"),
    ("reproduction", lambda d: d["rows"][0].pop("status"), "rows/0/status is missing"),
    ("reproduction", lambda d: d["rows"][0].update(paper="AutoDDL"), "rows/0/paper is 'AutoDDL', not an object"),
    ("reproduction", lambda d: d["rows"][0].update(sensitivity=[{"alpha_scale": 1}]), "rows/0/sensitivity/0/"),
    ("reproduction", lambda d: d["rows"][0].update(difference_pp=math.nan), "rows/0/difference_pp is nan"),
]


@pytest.fixture(scope="module")
def section_records(inputs, tmp_path_factory):
    """The good record of each kind: a summary of the executed records, a resharding results file, and a
    reproduction record (one kept in reports/records)."""
    root = tmp_path_factory.mktemp("section_records")
    (root / "executed").mkdir()
    for record in (inputs / "executed" / "good").glob("execute-*.json"):
        shutil.copy(record, root / "executed")
    rc, out, _, tb = run_main(["autotune", "execute", "--summarize", str(root / "executed")])
    assert rc == 0 and not tb, out + tb
    rc, out, _, tb = run_main(["autotune", "reshard", "--case", "1", "--results", str(root / "reshard.json")])
    assert rc == 0 and not tb, out + tb
    return {"summary": json.loads((root / "executed" / "summary.json").read_text()),
            "reshard": json.loads((root / "reshard.json").read_text()),
            "reproduction": json.loads((ROOT / "reports" / "records" / "sbp_reproduce_2026-11-25_issue29.json")
                                       .read_text())}


def test_the_good_section_records_are_reported(section_records, tmp_path):
    for name, record in section_records.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
        rc, out, _, tb = run_main(["reports", str(tmp_path / f"{name}.json"), "-o", str(tmp_path / f"{name}.html")])
        assert rc == 0 and not tb, out[-800:] + tb


@pytest.mark.parametrize("record, edit, expect", SECTION_CASES,
                         ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(SECTION_CASES)])
def test_a_broken_section_record_is_one_line(record, edit, expect, section_records, tmp_path):
    """A record with a field missing or of the wrong type: one line naming the field (it was a KeyError or
    TypeError traceback from the report section), no report written."""
    import copy

    data = copy.deepcopy(section_records[record])
    edit(data)
    path = tmp_path / f"{record}.json"
    path.write_text(json.dumps(data))
    rc, out, cpu_s, tb = run_main(["reports", str(path), "-o", str(tmp_path / "out" / "r.html")])
    check_outcome(rc, out, expect, cpu_s, tb)
    assert not (tmp_path / "out").exists()


def test_reports_on_execute_output_names_summarize(inputs, tmp_path):
    """``reports`` given an execute --out folder or one of its records says to summarize it first (it
    said "no meta.json" / "no report section knows"); given the summarized folder, it reports it."""
    folder = tmp_path / "exec"
    folder.mkdir()
    for record in (inputs / "executed" / "good").glob("execute-*.json"):
        shutil.copy(record, folder)
    for target in (folder, folder / "execute-00-x.json"):
        rc, out, cpu_s, tb = run_main(["reports", str(target), "-o", str(tmp_path / "out" / "r.html")])
        check_outcome(rc, out, "python -m autotune execute --summarize DIR", cpu_s, tb)
    assert run_main(["autotune", "execute", "--summarize", str(folder)])[0] == 0
    rc, out, _, tb = run_main(["reports", str(folder), "-o", str(tmp_path / "r.html")])
    assert rc == 0 and not tb and "Executed plans" in (tmp_path / "r.html").read_text(), out[-600:]
