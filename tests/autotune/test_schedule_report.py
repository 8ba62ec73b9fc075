"""Schedule autotuner: measured-result scoring and the report section (synthetic measurements
standing in for a GPU run: measured = a per-protocol affine law of the simulation)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.schedule.choose import finish
from autotune.schedule.cli import main
from autotune.schedule.result import NCCL, TuneResult
from reports.html import write_report
from reports.sections import builder

ROOT = Path(__file__).resolve().parents[2]
LAW = {"Simple": (6.0, 0.5), "LL": (2.0, 1.5)}     # us, factor


@pytest.fixture(scope="module")
def measured_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sched")
    data = json.loads((ROOT / "autotune/schedule/presets/spaces.json").read_text())
    data.update({"channels": [1], "instances": [1, 2], "blocks": [{"bytes_per_block": 65536, "max_split": 8}]})
    (tmp / "space.json").write_text(json.dumps(data))
    assert main(["--gpus", "2", "--profile", "gcp-a100", "--sizes", "1K,64K,4M", "--candidates", "2",
                 "--space", str(tmp / "space.json"), "--out", str(tmp / "out")]) == 0
    res = TuneResult.load(tmp / "out")
    res.measured, res.device, res.not_measured_reason = True, "synthetic", ""
    for coll in res.collectives:
        for b in coll.bands:
            b.nccl_measured_us = b.nccl_predicted_us
            for r in b.rows:
                if r.selected:
                    a, k = LAW[coll.candidates[r.key].protocol]
                    r.measured_us, r.correct, r.max_rel_err = a + k * r.model_us, True, 0.0
        finish(coll, measured=True)
    res.save(tmp / "measured.json")
    return tmp / "measured.json"


def test_measured_scoring(measured_result):
    res = TuneResult.load(measured_result)
    coll = res.collectives[0]
    s = coll.summary
    assert s["basis"] == "measured"
    assert s["speedup_over_nccl_min"] >= 1.0 - 1e-12          # NCCL takes any band it wins
    for b in coll.bands:
        assert all(r.selected for r in b.measured_rows())
        if b.choice != NCCL:
            assert b.row(b.choice).measured_us == min(r.measured_us for r in b.measured_rows())
    assert set(coll.correction["terms"]) <= {"Simple", "LL"}
    for p, t in coll.correction["terms"].items():
        assert (t["a_us"], t["k"]) == pytest.approx(LAW[p], rel=1e-6)
    # fixed contenders were measured in every band
    assert coll.fixed_baseline and all(b.row(coll.fixed_baseline).measured_us for b in coll.bands)


def test_report_section_renders(measured_result, tmp_path):
    sections = builder("schedule-tune")([measured_result])
    assert sections and "allreduce" in sections[0].title
    html = "".join(sections[0].blocks)
    assert "<svg" in html and "Spearman" in html
    out = write_report(tmp_path / "r.html", "t", sections)
    assert out.stat().st_size > 1000
