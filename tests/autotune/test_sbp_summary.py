"""The plan's summary line against the best baseline that fits, including one that predicts no cost at all."""
from autotune.plan.file import summary_lines


def _plan(name, seconds, fits=True):
    return {"strategy": name, "totals": {"total_s": seconds, "fits_memory": fits, "memory_bytes": 2**30}}


def test_speed_up_over_the_best_fitting_baseline():
    best = dict(_plan("searched", 1.0), memory_limit_bytes=None)
    lines = summary_lines(best, [_plan("data parallel", 2.0), _plan("Megatron", 1.5), _plan("big", 0.1, fits=False)])
    assert "1.50x (33.3% less) against the best baseline that fits, Megatron at 1.5 s/step" in lines[0]


def test_a_baseline_that_predicts_no_communication_is_named_not_divided_by():
    best = dict(_plan("pipelined", 0.2), memory_limit_bytes=None)
    lines = summary_lines(best, [_plan("data parallel (one device)", 0.0)])
    assert lines == ["searched plan: 0.2 s/step predicted communication; the best baseline that fits, "
                     "data parallel (one device), predicts none"]
