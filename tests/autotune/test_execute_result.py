"""The predicted-against-measured table of executed plans and the targets of issue 15."""
import pytest

from autotune.execute import result


def rec(name, pred_step, step, pred_comm, comm, pred_mem, mem):
    return {"kind": result.KIND, "version": result.VERSION, "strategy": name, "model": {"name": "gpt"},
            "cluster": {"nodes": 1, "gpus_per_node": 2}, "device": "H200", "backend": "nccl", "dtype": "bfloat16",
            "predicted": {"step_s": pred_step, "total_s": pred_comm, "memory_bytes": pred_mem},
            "measured": {"step_s": step, "comm_alone_s": comm, "comm_s": 3 * comm, "peak_memory_bytes": [mem, mem - 1],
                         "losses": [2.0, 1.5]}}


def test_targets_closed_form(tmp_path):
    recs = [rec("searched (step objective)", 0.100, 0.104, 0.010, 0.011, 100, 105),
            rec("data parallel", 0.200, 0.210, 0.020, 0.025, 200, 190),
            rec("Megatron", 0.300, 0.290, 0.030, 0.030, 300, 300)]
    for i, r in enumerate(recs):
        result.write_record(tmp_path, i, r)
    s = result.summary(result.load_records(tmp_path))
    t = s["targets"]
    assert t["spearman_step"]["value"] == pytest.approx(1.0) and t["spearman_step"]["met"]
    assert t["searched_vs_fastest"]["value"] == pytest.approx(0.0) and t["searched_vs_fastest"]["met"]
    # errors are (predicted - measured) / measured: data parallel's step -0.01 / 0.21
    assert t["worst_step_error"]["value"] == pytest.approx(0.01 / 0.21) and t["worst_step_error"]["met"]
    # the communication target compares the collectives replayed alone, not the in-step kernel time (3x here)
    assert t["worst_comm_error"]["value"] == pytest.approx(0.005 / 0.025) and not t["worst_comm_error"]["met"]
    assert t["worst_memory_error"]["value"] == pytest.approx(10 / 190)
    assert result.rows(recs)[0]["step_err"] == pytest.approx(-0.004 / 0.104)      # predicted too low: negative
    md = result.markdown(s)
    assert "worst_comm_error: 20.0% (target <= 15%): NOT met" in md and "Megatron" in md


def test_no_step_prediction_is_not_met_but_unknown():
    r = rec("searched", None, 0.1, 0.01, 0.01, 1, 1)
    r["predicted"].pop("step_s")
    t = result.targets(result.rows([r, r, r]))
    assert t["spearman_step"]["met"] is None and t["worst_step_error"]["met"] is None


def test_a_pipelined_plans_memory_is_compared_stage_by_stage(tmp_path):
    """Each stage's prediction beside the peak of its own ranks: the loss stage 10 under its prediction shows, where
    the largest prediction beside the largest peak (two stages) would show 4; a bad list is refused."""
    r = rec("pipelined", 0.1, 0.1, 0.01, 0.01, 104, 0)
    r["predicted"]["stage_memory_bytes"] = [104, 90]
    r["measured"]["peak_memory_bytes"] = [101, 100]
    row = result.rows([r])[0]
    assert (row["pred_memory_bytes"], row["memory_bytes"]) == (90, 100) and row["memory_err"] == pytest.approx(-0.1)
    r["predicted"]["stage_memory_bytes"] = [104, "x"]
    result.write_record(tmp_path, 0, r)
    with pytest.raises(Exception, match="predicted/stage_memory_bytes"):
        result.load_records(tmp_path)
