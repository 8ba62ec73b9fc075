"""Closed forms of the pipeline step model: the 1F1B bubble, the micro-batches each stage keeps in
flight, and a boundary the schedule hides entirely."""
import itertools

import pytest

from autotune.pipeline.search import inflight
from autotune.pipeline.split import estimate
from autotune.reshard.pipeline import PipelineSpec, exposed_time, simulate


def _uniform(p, m, f, b, comm=0.0):
    return PipelineSpec("u", m, (f,) * p, (b,) * p, (comm,) * (p - 1), (comm,) * (p - 1), (0.0,) * p)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 16), (8, 8), (3, 7)])
def test_1f1b_bubble_is_p_minus_1_stage_times(p, m):
    f, b = 1.0, 2.0
    r = simulate(_uniform(p, m, f, b), "1f1b")
    assert r.makespan == pytest.approx((m + p - 1) * (f + b))
    bubble = r.makespan - m * (f + b)
    assert bubble / (m * (f + b)) == pytest.approx((p - 1) / m)  # 15/48 for 16 stages and 48 micro-batches
    assert estimate([f + b] * p, m) == pytest.approx(r.makespan)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "eager_1f1b"])
def test_inflight_is_what_the_schedule_keeps(schedule):
    for p, m in itertools.product((1, 2, 4, 5), (1, 3, 8)):
        r = simulate(_uniform(p, m, 1.0, 2.0), schedule)
        want = [inflight(schedule, i, p, m) for i in range(p)]
        assert r.peak_activations == want
        closed = {"1f1b": [min(m, p - i) for i in range(p)], "gpipe": [m] * p,
                  "eager_1f1b": [min(m, 2 * (p - i) - 1) for i in range(p)]}[schedule]
        assert want == closed


def test_boundary_hidden_by_eager_1f1b():
    # stage 0 is the bottleneck (6 s per micro-batch), stage 1 has 3 s of slack per micro-batch: eager-1F1B's
    # extra warm-up forwards keep stage 0 busy while each 0.5 s transfer runs; 1F1B waits for the first gradient
    spec = PipelineSpec("h", 8, (2.0, 1.0), (4.0, 2.0), (0.5,), (0.5,), (0.0, 0.0))
    assert exposed_time(spec, "eager_1f1b") == 0.0
    assert simulate(spec, "eager_1f1b").makespan == pytest.approx(8 * 6.0)  # stage 0's work, back to back
    assert exposed_time(spec, "1f1b") == pytest.approx(1.0)
