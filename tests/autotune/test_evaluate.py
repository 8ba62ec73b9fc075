"""Confirmatory evaluation without GPUs: what the evaluate commands refuse before any device work,
the schedule evaluation's summary against closed forms, the tables rendered from records."""
from __future__ import annotations

import json

import pytest

from autotune.nccl import record as rec
from autotune.nccl.cli import main as nccl_main
from autotune.schedule.evaluate import Point, summary
from calibrate.errors import UserError
from calibrate.measure.engine import ArmResult, Status
from calibrate.measure.heldout import declare
from kernels.nccl_tuner.table import Row, write_table


def arm(name, us=None, status=Status.OK, reason="", wrong=(0, 0)):
    a = ArmResult(name, status, reason, 20, [us * 1e-6] * 3 if us else [], *wrong).to_dict()
    return a | {"max_rel_err": 0.0}


def test_schedule_summary_is_medians_at_the_heldout_sizes():
    pts = [Point("allreduce", 3000, "p (LL, split 2)", [arm("tuned", 4.0), arm("nccl", 6.0), arm("nccl best", 5.0),
                                                         arm("fixed k", 5.0)]),
           Point("allreduce", 90000, "nccl", [arm("tuned", 10.0), arm("nccl", 9.0), arm("nccl best", 9.9),
                                              arm("fixed k", 12.5)])]
    s = summary(pts)["allreduce"]
    assert s["over_nccl_geomean"] == pytest.approx((6 / 4 * 9 / 10) ** 0.5)
    assert s["over_nccl_min"] == pytest.approx(0.9) and s["over_fixed_geomean"] == pytest.approx((5 / 4 * 1.25) ** 0.5)
    assert s["over_nccl_best_min"] == pytest.approx(0.99)
    states = {v["target"]: v["state"] for v in s["verdicts"]}
    assert states == {"tuned >= 0.98x NCCL at every held-out size": "not met",
                      "tuned >= 0.98x NCCL's best setting at every held-out size": "met",
                      "tuned faster than the best fixed configuration (geomean)": "met", "wrong_0": "met"}


def test_schedule_summary_unknown_where_an_arm_is_missing_and_wrong_counted():
    pts = [Point("allreduce", 3000, "x", [arm("tuned", 4.0), arm("nccl", 6.0),
                                          arm("fixed k", status=Status.FAILED, reason="did not start: no fit")]),
           Point("allreduce", 9000, "x", [arm("tuned", 4.0, Status.WRONG, "2 wrong", (0, 2)), arm("nccl", 6.0),
                                          arm("fixed k", 5.0)])]
    s = summary(pts)["allreduce"]
    v = {x["target"]: x for x in s["verdicts"]}
    assert v["tuned >= 0.98x NCCL at every held-out size"]["state"] == "unknown"
    assert "tuned at 9000 B: wrong" in v["tuned >= 0.98x NCCL at every held-out size"]["why"]
    assert v["tuned faster than the best fixed configuration (geomean)"]["state"] == "unknown"
    assert v["wrong_0"]["state"] == "not met" and s["wrong"] == 2


@pytest.fixture
def dev_run(tmp_path):
    """A development record with a held-out declaration and the table file it chose."""
    rows = [Row("allreduce", 0, 1 << 20, "ring", "ll", -1, 1, 2)]
    table = tmp_path / "nccl_tuner.csv"
    table.write_text(write_table(rows))
    sizes = [1 << k for k in range(10, 21)]
    dec = declare("autotune nccl", {"allreduce": sizes}, sizes[0], sizes[-1], 3, 26, 2048, "2026-11-25T17:00:00Z")
    r = rec.TuneRecord("d", "c", "2 x H200", 22809, 2, 1, "float32", "graph", 20, 5, 64, ["allreduce"], sizes,
                       "/p.so", table=str(table), table_rows=[x.line() for x in rows], heldout=dec.to_dict())
    r.save(tmp_path / "nccl_tune.json")
    return tmp_path, r


def test_nccl_evaluate_refuses_edited_heldout_sizes_tables_and_old_records(dev_run, capsys):
    out, r = dev_run
    data = json.loads((out / "nccl_tune.json").read_text())
    data["heldout"]["evaluation"]["allreduce"][0] += 2048           # another held-out size: the hash is stale
    (out / "nccl_tune.json").write_text(json.dumps(data))
    assert nccl_main(["evaluate", str(out)]) == 2
    assert "does not match its hash" in capsys.readouterr().err
    data["heldout"]["evaluation"]["allreduce"] = [1 << 12]           # a development size
    (out / "nccl_tune.json").write_text(json.dumps(data))
    assert nccl_main(["evaluate", str(out)]) == 2
    assert "both development and evaluation" in capsys.readouterr().err
    r.save(out / "nccl_tune.json")
    (out / "nccl_tuner.csv").write_text(write_table([Row("allreduce", 0, 1 << 20, "ring", "simple", -1, 1, 2)]))
    assert nccl_main(["evaluate", str(out)]) == 2
    assert "differs from the rows its record chose" in capsys.readouterr().err
    old = rec.TuneRecord(**{**r.__dict__, "heldout": {}})
    old.save(out / "nccl_tune.json")
    assert nccl_main(["evaluate", str(out / "nccl_tune.json")]) == 2
    err = capsys.readouterr().err
    assert "declares no held-out sizes" in err and err.count("\n") == 1


def test_heldout_sizes_are_off_the_development_grid(dev_run):
    _, r = dev_run
    ev = r.heldout["evaluation"]["allreduce"]
    assert len(ev) == 3 and not set(ev) & set(r.sizes) and all(n % 2048 == 0 for n in ev)


def test_schedule_evaluate_refuses_a_model_only_run(tmp_path):
    from autotune.schedule.cli import main as schedule_main
    from autotune.schedule.result import TuneResult

    TuneResult("2026-11-25", 2, 1, 2, "p", "float32", "s", measured=False).save(tmp_path / "schedule.json")
    with pytest.raises(UserError, match="not measured"):
        schedule_main(["evaluate", str(tmp_path)])


def test_tables_rendered_from_records_and_stale_blocks_found(tmp_path):
    from reports.tables import render, update

    evaluation = rec.EvaluateRecord(
        "2026-11-25", "python -m autotune nccl evaluate r/", "abc123", "2 x H200", 22809, 2, 1, "float32", 64,
        "r/nccl_tune.json", {"sha256": "f" * 64}, [], {}, 5,
        compare=[rec.Compare("allgather", 1 << 30, "ring/simple/auto", 125.6, 100.0, 0, 0,
                             arms=[arm("default", 125.6), arm("min_ctas", 101.0), arm("table", 124.0),
                                   arm("tuned", 100.0)])])
    evaluation.save(tmp_path / "ev.json")
    text = render(tmp_path / "ev.json")
    assert "**evaluation**" in text and "commit `abc123`" in text and "| allgather | 1073741824 | 125.60 | 100.00 | 1.256 |" \
        in text and "| 1.010 | 1.240 |" in text and "min_ctas 1.244x" in text
    md = tmp_path / "x.md"
    md.write_text("prose\n<!-- table: ev.json -->\nold\n<!-- end table -->\nmore prose\n")
    assert update(md, check=True) == ["ev.json"] and "old" in md.read_text()
    assert update(md) == ["ev.json"] and update(md, check=True) == []
    assert md.read_text().startswith("prose\n") and md.read_text().endswith("more prose\n")


def test_schedule_summary_reports_each_knobs_share():
    pts = [Point("allreduce", n, "x", [arm("tuned", 4.0), arm("nccl", 6.0), arm("fixed k", 6.0),
                                       arm("tuned, protocol as fixed", 5.0), arm("tuned, max_split as fixed", 4.4)])
           for n in (3000, 9000)]
    k = summary(pts)["allreduce"]["knob_share"]
    assert k["protocol"]["share_geomean"] == pytest.approx(1.25) and k["max_split"]["share_geomean"] == \
        pytest.approx(1.1) and set(k) == {"protocol", "max_split"}


def test_nccl_evaluate_of_a_run_that_declined_every_collective_is_one_line(dev_run, capsys):
    out, r = dev_run
    (out / "nccl_tuner.csv").write_text(write_table([]))
    rec.TuneRecord(**{**r.__dict__, "table_rows": [], "declined": ["allreduce"]}).save(out / "nccl_tune.json")
    assert nccl_main(["evaluate", str(out)]) == 2
    err = capsys.readouterr().err
    assert "declined every collective (allreduce" in err and "nothing to evaluate" in err and err.count("\n") == 1
