"""The layer table's composition of the plan's predictions (a layer's own figures plus the boxing into it,
times the micro-batches) beside a record's layer clock."""

import pytest

from autotune.execute.layertable import layer_rows  # noqa: E402


def test_rows_add_the_boxing_into_each_layer():
    rec = {"strategy": "p", "micro_batches": 2,
           "measured": {"step_s": 1.0, "layer_clock": {
               "layers": [{"name": "x", "kind": "matmul", "forward_s": 0.1, "backward_s": 0.2},
                          {"name": "y", "kind": "matmul", "forward_s": 0.05, "backward_s": 0.1},
                          {"name": "x", "kind": "matmul", "forward_s": 0.1, "backward_s": 0.2}],
               "optimizer_s": 0.03}},
           "predicted": {"step_s": 0.9},
           "predicted_layers": {"x": {"forward_s": 0.08, "backward_s": 0.16, "optimizer_s": 0.01},
                                "y": {"forward_s": 0.04, "backward_s": 0.08, "optimizer_s": 0.02},
                                "x->y": {"forward_s": 0.01, "backward_s": 0.02},
                                "y->x": {"forward_s": 0.005, "backward_s": 0.0}}}
    rows = {r["layer"]: r for r in layer_rows(rec)}
    assert rows["x"]["positions"] == 2
    assert rows["x"]["pred_fwd_s"] == pytest.approx(2 * (0.08 + 0.08 + 0.005))  # first x has no in-edge
    assert rows["x"]["fwd_s"] == pytest.approx(2 * 0.2)
    assert rows["y"]["pred_bwd_s"] == pytest.approx(2 * (0.08 + 0.02))
    assert rows["y"]["fwd_err"] == pytest.approx(rows["y"]["pred_fwd_s"] / rows["y"]["fwd_s"] - 1)
    assert rows["optimizer"]["pred_fwd_s"] == pytest.approx(0.01 + 0.02 + 0.01)
    measured = 2 * (0.1 + 0.2 + 0.05 + 0.1 + 0.1 + 0.2) + 0.03
    assert rows["rest of step"]["fwd_s"] == pytest.approx(1.0 - measured)
