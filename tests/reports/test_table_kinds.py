"""The renderers added for the record pages, on small records whose figures are known in closed form."""
from __future__ import annotations

import json

import pytest

from calibrate.errors import UserError
from reports.tables import render


def _write(tmp_path, name, d):
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return path


def _row(ident, kind, pred_ms, ms, pred_gib, gib):
    return {"id": ident, "set": kind, "family": "gpt", "pred_step_s": pred_ms / 1e3, "step_s": ms / 1e3,
            "pred_bytes": pred_gib * 2**30, "peak_bytes": gib * 2**30, "note": ""}


def test_transformer_check_known_by_its_fields_one_relative_error(tmp_path):
    rows = [_row("D1", "development", 110, 100, 10, 10), _row("H1", "heldout", 90, 100, 12, 10),
            _row("H2", "heldout", 103, 100, 10, 10), _row("H3", "heldout", 100, 100, 10, 10)]
    text = render(_write(tmp_path, "t.json", {"shapes_sha256": "abc", "profile": "p.json", "recompute": "none",
                                              "rows": rows}))
    assert "kind `transformer-check`" in text
    assert "| D1 | development | gpt | 110.00 | 100.00 | +10.0% | 10.00 | 10.00 | +0.0% |  |" in text
    assert "| H1 | heldout | gpt | 90.00 | 100.00 | -10.0% | 12.00 | 10.00 | +20.0% |  |" in text
    # held-out errors -10%, +3%, 0%: median 0%, median |error| 3%, worst -10% at H1; memory worst +20% at H1
    assert ("- heldout (3 shapes): step median +0.0%, median |error| 3.0%, worst -10.0% (H1); memory median +0.0%, "
            "median |error| 0.0%, worst +20.0% (H1)") in text


def test_a_record_of_no_known_kind_is_refused_naming_the_kinds(tmp_path):
    with pytest.raises(UserError, match="transformer-check"):
        render(_write(tmp_path, "x.json", {"rows": []}))


def test_sbp_validate_in_measured_order_with_its_error(tmp_path):
    d = {"kind": "commtune.sbp-validate", "version": 1, "backend": "nccl", "cluster": "1 node x 2 GPUs",
         "profile": "p", "mode": "graph", "dtype": "float16", "spearman": -1.0,
         "plans": [{"plan": "a", "predicted_s": 0.001, "measured_s": 0.004},
                   {"plan": "b", "predicted_s": 0.002, "measured_s": 0.002}]}
    text = render(_write(tmp_path, "v.json", d))
    assert text.index("| b | 0.002 | 0.002 | +0.0% |") < text.index("| a | 0.001 | 0.004 | -75.0% |")
    assert "(predicted vs measured, 2 plans): -1.000; worst |error| 75.0%" in text


def test_kernels_bench_geomeans_by_size_range(tmp_path):
    rows = [{"collective": "allreduce", "bytes": b, "dtype": "float32", "program": "p", "protocol": "LL", "split": 1,
             "interp_us": 1.0, "nccl_us": s, "speedup": s, "interp_busbw_gbs": 1.0, "nccl_busbw_gbs": 1.0 / s,
             "correct": True} for b, s in ((1024, 2.0), (1 << 20, 8.0), (1 << 30, 1.0))]
    d = {"kind": "kernels-bench", "version": 1, "date": "2026-11-27", "device": "d", "nranks": 2, "preset": "x",
         "rows": rows}
    text = render(_write(tmp_path, "b.json", d))
    # geomean of 2, 8, 1 = 16 ** (1/3); 1 KiB alone below 256 KiB, 1 MiB alone in 256 KiB..64 MiB
    assert (f"- allreduce float32: NCCL / interp geomean {16 ** (1 / 3):.2f}x (1 B..256 KiB 2.00x, 256 KiB..64 MiB "
            "8.00x, > 64 MiB 1.00x); worst 1.00x at 1 GiB") in text
    assert "3 of 3 correct" in text


def test_reshard_speedups_against_the_baselines(tmp_path):
    times = {"send_recv": {"greedy_in_order": 4.0}, "local_allgather": {"greedy_in_order": 2.0},
             "global_allgather": {"greedy_in_order": 3.0}}
    case = {"case": "case 1", "unit_tasks": 2, "lower_bound": 0.5, "times": times, "chosen": {"makespan": 1.0},
            "task": {"src_spec": "S0RR", "dst_spec": "RRR", "src_mesh": {"shape": [2, 4]},
                     "dst_mesh": {"shape": [2, 4]}}}
    d = {"kind": "reshard", "version": 1, "profile": "p", "cases": [case], "pipelines": [], "executed": []}
    text = render(_write(tmp_path, "r.json", d))
    assert "| 1 | 2 | 4.000 | 2.000 | 3.000 | 1.000 | 0.500 | 2.000 | 4.00 | 3.00 |" in text


def test_autoddl_reproduction_record_renders_its_verdicts():
    from pathlib import Path

    records = Path(__file__).resolve().parents[2] / "reports" / "records"
    text = render(records / "sbp_reproduce_2026-11-27_tied.json")
    # the page's session 3: 9 of the 12 modelled cases pass, pipeline-table3 not modelled
    assert "- 9 of 13 cases pass" in text
    assert "| pipeline-table3 |" in text and "| not modelled |" in text
    assert "| gpt-small-gcp |" in text
