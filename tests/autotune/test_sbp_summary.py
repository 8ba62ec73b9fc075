"""The plan's summary line against the best baseline that fits, including one that predicts no cost at all."""
from types import SimpleNamespace

from autotune.plan.file import summary_lines
from autotune.plan.typed import Costs


def _plan(name, seconds, fits=True):  # what the summary reads of a Plan
    return SimpleNamespace(strategy=name, costs=Costs(0.0, 0.0, seconds, 2**30, fits), memory_limit_bytes=None)


def test_speed_up_over_the_best_fitting_baseline():
    best = _plan("searched", 1.0)
    lines = summary_lines(best, [_plan("data parallel", 2.0), _plan("Megatron", 1.5), _plan("big", 0.1, fits=False)])
    assert "1.50x (33.3% less) against the best baseline that fits, Megatron at 1.5 s/step" in lines[0]


def test_a_baseline_that_predicts_no_communication_is_named_not_divided_by():
    best = _plan("pipelined", 0.2)
    lines = summary_lines(best, [_plan("data parallel (one device)", 0.0)])
    assert lines == ["searched plan: 0.2 s/step predicted communication; the best baseline that fits, "
                     "data parallel (one device), predicts none"]
