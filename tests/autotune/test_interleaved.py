"""Interleaved 1F1B (issue 43): the simulated step against its closed form, and the search's memory count."""
import pytest

from calibrate.errors import UserError
from autotune.pipeline.search import inflight
from autotune.reshard.pipeline import INTERLEAVED, PipelineSpec, interleaved_orders, simulate


def _uniform(p, v, m, f=1.0, b=2.0, comm=0.0):
    s = p * v
    return PipelineSpec("x", m, (f / v,) * s, (b / v,) * s, (comm,) * (s - 1), (comm,) * (s - 1), (0.0,) * s)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (8, 2, 16), (4, 2, 4), (4, 4, 12)])
def test_bubble_is_p_minus_1_over_v_m(p, v, m):
    """Equal stages, no transfers: makespan = m (f + b) + (p - 1)(f + b) / v, torch's ScheduleInterleaved1F1B
    bubble (p - 1) / (v m) of the compute, against 1F1B's (p - 1) / m."""
    f, b = 1.0, 2.0
    got = simulate(_uniform(p, v, m, f, b), INTERLEAVED, ranks=p).makespan
    assert got == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)
    one = simulate(_uniform(p, 1, m, f, b), "1f1b").makespan
    assert one == pytest.approx((m + p - 1) * (f + b)) and got < one


def test_every_task_once_and_micro_batches_in_groups_of_p():
    p, v, m = 4, 2, 8
    orders = interleaved_orders(p, v, m)
    for r, order in enumerate(orders):
        assert sorted(order) == sorted((k, mb, c * p + r) for k in "FB" for mb in range(m) for c in range(v))
    # rank 0's first forwards: micro-batches 0..p-1 on chunk 0, then the same on chunk 1
    assert orders[0][:2 * p] == [("F", i, 0) for i in range(p)] + [("F", i, p) for i in range(p)]
    with pytest.raises(UserError, match="multiple of 4"):
        interleaved_orders(4, 2, 6)


def test_extra_p2p_is_on_the_path():
    """v chunks: a micro-batch crosses p v - 1 boundaries; with transfers, the warm-up pays them v times."""
    p, v, m, c = 4, 2, 8, 0.05
    with_comm = simulate(_uniform(p, v, m, comm=c), INTERLEAVED, ranks=p)
    free = simulate(_uniform(p, v, m), INTERLEAVED, ranks=p)
    assert with_comm.makespan >= free.makespan + (p * v - 1) * c - 1e-9


def test_in_flight_memory_count():
    """Rank 0 keeps (p - 1) 2 + (v - 1) p + 1 chunks in flight, each 1/v of its layers."""
    p, v, m = 4, 2, 16
    assert inflight(INTERLEAVED, 0, p, m, v) == -(-((p - 1) * 2 + (v - 1) * p + 1) // v)
    assert simulate(_uniform(p, v, m), INTERLEAVED, ranks=p).peak_activations[0] == (p - 1) * 2 + (v - 1) * p + 1
    assert inflight("1f1b", 0, p, m) == p


def test_chunked_exposed_sync_closed_forms():
    """Interleaved 1F1B: each chunk's sync (S / v) from its own last backward on (hidden behind its W / v), the
    chunks one after another, the first layer's F after the rank's end; one chunk is steptime's max(S - W, F)."""
    from autotune.pipeline.search import chunked_exposed
    from autotune.sbp.steptime import overlapped
    # ends 1, 2, 4; S 3, W 0.6: the syncs run 0.8-1.8, 1.8-2.8, 3.8-4.8: 0.8 s after the end at 4
    assert chunked_exposed([2.0, 4.0, 1.0], 3.0, 0.6, 0.1) == pytest.approx(0.8)
    assert chunked_exposed([2.0, 4.0, 1.0], 3.0, 0.6, 1.5) == pytest.approx(1.5)
    for S, W, F, k in ((3.0, 1.0, 0.5, 1.0), (3.0, 1.0, 2.5, 1.0), (0.5, 1.0, 0.1, 1.2), (3.0, 1.0, 0.5, 1.1)):
        assert chunked_exposed([5.0], S, W, F, k) == pytest.approx(float(overlapped(S, W, F, k)))
    assert chunked_exposed([2.0, 4.0, 1.0], 3.0, 0.6, 0.1, 1.1) == pytest.approx(0.8 + 0.1 * 2.2)
