"""The layer clock's arithmetic (a position's backward runs from its output's gradient to the
previous position's) on scripted marks through real autograd hooks, and the layer table's
composition of the plan's predictions (a layer's own figures plus the boxing into it, times the
micro-batches)."""
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
import torch  # noqa: E402

from autotune.execute.layerclock import LayerClock  # noqa: E402
from autotune.execute.layertable import layer_rows  # noqa: E402


class ScriptedClock(LayerClock):
    """Marks are the next of scripted times, in the order the clock asks for them."""

    def __init__(self, names, times):
        super().__init__(names, gpu=False)
        self.times = iter(times)

    def mark(self):
        return next(self.times)


def test_spans_follow_autograd_order():
    # fwd marks (start, end) x 3, then the gradients of positions 2, 1, 0, then backward's end, then the optimizer
    clock = ScriptedClock([("a", "matmul"), ("b", "pointwise"), ("c", "loss")], [0, 1, 3, 6, 10, 15, 21, 28, 36, 45, 50, 52])
    w = torch.ones(3, requires_grad=True)
    clock.micro_batch()
    with clock.around(0):
        y0 = w * 2
    clock.after(0, y0)
    with clock.around(1):
        y1 = y0 * 3
    clock.after(1, y1)
    with clock.around(2):
        y2 = y1.sum()
    clock.after(2, y2)
    y2.backward()
    clock.backward_done()
    with clock.optimizer():
        pass
    res = clock.result()
    assert [x["forward_s"] for x in res["layers"]] == [1, 3, 5]
    assert [x["backward_s"] for x in res["layers"]] == [9, 8, 7]
    assert res["optimizer_s"] == 2


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
