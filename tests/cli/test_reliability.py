"""The pieces the bad-input and fault suites rely on, each against a closed form."""
from __future__ import annotations

import argparse
import json
import math

import pandas as pd
import pytest

from calibrate.cli import finite_float, launcher_rank, run_cli
from calibrate.errors import OptionError, UserError
from calibrate.jsonfile import non_finite, write_json
from calibrate.profile import Profile
from calibrate.results import ResultsDir
from calibrate.run_limits import MAX_CALLS_PER_SIZE, check_counts
from calibrate.validation import fairness_warnings
from tests.cli.badrecords import make_results


def test_write_json_never_writes_nan(tmp_path):
    path = tmp_path / "plan.json"
    write_json(path, {"ok": 1})
    with pytest.raises(UserError, match=r"best/totals/total_s=nan, which is not a finite number: nothing was written"):
        write_json(path, {"best": {"totals": {"total_s": math.nan}}}, "plan file")
    assert json.loads(path.read_text()) == {"ok": 1}
    assert non_finite({"a": [1.0, {"b": -math.inf}]}) == "a/1/b=-inf"
    assert non_finite({"a": [1.0, 2]}) is None


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400"])
def test_finite_float_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a finite number"):
        finite_float(text)


def test_finite_float_accepts():
    assert finite_float("1.5") == 1.5 and finite_float("-2e3") == -2000.0


def test_calls_per_size_bounded():
    check_counts(1000, 0, 1000)  # 1,000,000 calls: the most
    with pytest.raises(OptionError, match=r"1,000,005 calls per size"):
        check_counts(1000, 5, 1000)
    with pytest.raises(OptionError, match=r"1,000,000,005 calls per size, at least 2,000 s for 1 size"):
        check_counts(10 ** 9, 5, 1)
    with pytest.raises(OptionError):
        check_counts(MAX_CALLS_PER_SIZE, 1, 1)
    check_counts(MAX_CALLS_PER_SIZE - 1, 1, 1)


def test_errors_print_once_under_a_launcher(monkeypatch, capsys):
    def bad(argv):
        raise UserError("broken: fix it")
    for var in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert launcher_rank() == 0
    monkeypatch.setenv("PMI_RANK", "1")
    assert launcher_rank() == 1 and run_cli(bad, [], "x") == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("PMI_RANK", "0")
    assert run_cli(bad, [], "x") == 2
    assert capsys.readouterr().err == "x: error: broken: fix it\n"


def test_fairness_warnings(tmp_path):
    """A GPU profile judged on host CPUs, another timing mode, and group sizes it never measured."""
    runs = []
    for ranks in (2, 4):
        rd = ResultsDir(make_results(tmp_path / f"r{ranks}", collectives=("allreduce",), ranks=ranks))
        runs.append((rd.read_meta(), rd.stats()))
    prof = Profile.load("h200-nvlink")  # NVIDIA H200, graph mode, 2-rank models measured up to 1 GiB
    text = "\n".join(fairness_warnings(prof, runs))
    assert "is of NVIDIA H200; these measurements are of host CPUs (backend mpi)" in text
    assert "timed in graph mode, these measurements in host mode" in text
    assert "intra allreduce on 4 ranks: the profile has no model for that group size; predicted from its " \
           "2-rank model" in text
    assert "on 2 ranks" not in text
    assert fairness_warnings(prof, [(dict(runs[0][0], ranks=[{"gpu": "NVIDIA H200"}] * 2,
                                          config=dict(runs[0][0]["config"], mode="graph")), runs[0][1])]) == []


def test_plan_placements_must_span_the_fine_mesh():
    from autotune.plan.typed import FineMesh, Plan
    from autotune.sbp.mesh import Cluster
    mesh = FineMesh.of(Cluster(2, 4))
    layer = {"name": "l", "kind": "matmul", "count": 1, "signature": "s", "input": ["B"] * len(mesh.sizes)}
    plan = {"model": {"kind": "gpt"}, "cluster": {"nodes": 2, "gpus_per_node": 4},
            "mesh": {"sizes": list(mesh.sizes), "names": list(mesh.names)}, "layers": [layer]}
    assert Plan.from_dict(plan, "p").layers[0].input == tuple(layer["input"])
    layer["input"] = ["B"] * (len(mesh.sizes) + 1)
    with pytest.raises(UserError, match=r"p: layer 0.input: \d+ placements for a mesh of \d+ fine axes"):
        Plan.from_dict(plan, "p")


def test_results_samples_leave_out_sizes_without_stats(tmp_path):
    res = make_results(tmp_path / "r", collectives=("allreduce",))
    rd = ResultsDir(res)
    n = len(rd.samples())
    with open(res / "samples.csv", "a") as f:
        f.write("world:2x1,intra,2,1,allreduce,host,float32,999,249,0,0.001\r\n")
    assert len(pd.read_csv(res / "samples.csv")) == n + 1 and len(rd.samples()) == n


def test_report_cells_are_for_people():
    from reports.html import cell_text, table_html

    assert cell_text(float("nan")) == "-" and cell_text(float("inf"), "total_s") == "-"
    assert cell_text(4.611686018427388e18, "max_bytes") == "no limit"
    assert cell_text(False) == "no" and cell_text(None) == "-"
    assert cell_text(1536, "bytes") == "1.5 KiB" and cell_text(64 << 20, "bytes") == "64 MiB"
    assert cell_text(3.2e-6, "median_s") == "3.2 us" and cell_text(0.0125, "step_s") == "12.5 ms"
    assert cell_text({"a": 1.5, "b": True}) == "a: 1.5, b: yes"
    html = table_html(pd.DataFrame({"bytes": [1024, 2 ** 62], "median_s": [float("nan"), 2.0],
                                    "fits": [True, False], "extra": [{"k": 1}, [1, 2]]}))
    for bad in ("nan", "inf", "e+18", "True", "False", "{"):
        assert bad not in html


def test_schedule_report_gives_band_sizes_for_people(tmp_path):
    """The schedule section's band table: sizes in B/KiB/MiB and the last band open ("no limit"), not raw
    byte counts ending in "inf"."""
    import re

    from autotune.schedule.cli import main as schedule_main
    from reports.__main__ import main as reports_main

    schedule_main(["--model-only", "--sizes", "1K:1M:3", "--out", str(tmp_path / "s")])
    reports_main([str(tmp_path / "s" / "schedule.json"), "-o", str(tmp_path / "r.html")])
    page = (tmp_path / "r.html").read_text()
    cells = re.findall(r"<td>([^<]*)</td>", page)
    assert "no limit" in cells and "1 KiB" in cells
    assert not [c for c in cells if c in ("inf", "nan") or re.fullmatch(r"\d{4,}", c)], cells


def test_a_search_out_folder_is_a_report_input(tmp_path):
    """``python -m reports DIR`` on the folder ``python -m autotune --out DIR`` (or ``tune``) wrote: its plan.json's
    section, as a calibration run's folder gives its meta.json's."""
    from autotune.__main__ import main as autotune_main
    from reports.__main__ import main as reports_main

    assert autotune_main(["--model", "gpt", "--preset", "gpt2", "--layers", "1", "--nodes", "1", "--gpus-per-node",
                          "2", "--budget", "50steps", "--compare", "none", "--out", str(tmp_path / "plan")]) == 0
    assert reports_main([str(tmp_path / "plan"), "-o", str(tmp_path / "r.html")]) == 0
    assert "searched (cd)" in (tmp_path / "r.html").read_text()


def test_report_chart_shows_what_the_headline_compares():
    from autotune.plan import Costs
    from reports.sections.sbp import _breakdown_fig, _objective

    totals = {"redistribution_s": 1.0, "grad_sync_s": 2.0, "total_s": 3.0, "memory_bytes": 1.0, "fits_memory": True}
    plans = [("a", Costs.from_dict(dict(totals, compute_s=10.0, exposed_comm_s=1.5, step_s=11.5), "a")),
             ("b", Costs.from_dict(dict(totals, compute_s=10.0, exposed_comm_s=3.0, step_s=13.0), "b"))]
    assert _objective(plans, "step") == "step" and _objective(plans, "comm") == "comm"
    fig = _breakdown_fig(plans, "step")
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("predicted step time")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["compute", "exposed communication"]
    assert [t.get_text() for t in ax.texts] == ["11.5 s", "13 s"]
    no_compute = [("a", Costs.from_dict(totals, "a"))]
    assert _objective(no_compute, "step") == "comm"


class _Parsed(Exception):
    pass


# every command whose options this suite holds to a help line (calibrate compute and the search have owners
# of their own)
HELPED = [("calibrate", "run"), ("calibrate", "fit"), ("calibrate", "validate"), ("calibrate", "profiles"),
          ("autotune", "validate"), ("autotune", "reshard"), ("autotune", "schedule"), ("autotune", "nccl"),
          ("autotune", "reproduce"), ("autotune", "explain"), ("kernels", "compile"), ("kernels", "check"),
          ("kernels", "bench"), ("kernels", "peers"), ("kernels", "tp-mlp"), ("kernels", "reshard"),
          ("kernels", "build-tuner"), ("reports", ""), ("autotune", "execute")]


@pytest.mark.parametrize("package, command", HELPED, ids=[f"{p}-{c}" for p, c in HELPED])
def test_every_option_has_a_help_line(package, command, monkeypatch):
    """The parser a command builds, caught at parse time: each option and argument says what it is."""
    import importlib

    from calibrate.cli import CommandParser

    def catch(self, args=None, namespace=None):
        raise _Parsed(self)
    monkeypatch.setattr(CommandParser, "parse_args", catch)
    monkeypatch.setattr(CommandParser, "parse_known_args", lambda self, *a, **k: catch(self))
    if package == "reports":
        main = importlib.import_module("reports.__main__").main
    else:
        module, func = importlib.import_module(f"{package}.__main__").SUBCOMMANDS[command].split(":")
        main = getattr(importlib.import_module(module), func)
    with pytest.raises(_Parsed) as got:
        main([])
    parser = got.value.args[0]
    bare = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions
            if not (a.help or "").strip() and a.dest != "help"]
    assert not bare, f"options without a help line: {', '.join(bare)}"


def test_gpu_run_all_exits_non_zero_when_a_part_fails(tmp_path):
    """tests/gpu/run_all.sh's own exit counts every part: a failed transformer check (here: no Python)
    makes it non-zero (the transformer part was logged, not counted, and the script exited 0)."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(["bash", "tests/gpu/run_all.sh"], cwd=root, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OUT=str(tmp_path), PARTS="transformer", PY="false"))
    assert "transformer (tests/gpu/transformer_check.sh): exit 1" in r.stdout, r.stdout[-800:]
    assert r.returncode != 0
