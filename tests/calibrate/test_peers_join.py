"""``calibrate.device.peers.join_within``: spawned measurement processes that fail, or hang past their limit, end the
run with one line naming the measurement, every process stopped (CPU processes stand in for the NCCL group's)."""
import time

import pytest

from calibrate.errors import UserError

torch = pytest.importorskip("torch")


def _sleep(rank: int, seconds: float) -> None:
    time.sleep(seconds)


def _fail(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("NCCL error: unhandled system error")


def _start(fn, args):
    import torch.multiprocessing as mp
    return mp.start_processes(fn, args=args, nprocs=2, start_method="spawn", join=False)


def test_a_hung_measurement_stops_within_its_limit_in_one_line():
    from calibrate.device.peers import join_within
    context = _start(_sleep, (60.0,))
    t0 = time.monotonic()
    with pytest.raises(UserError, match="the test's job did not finish in 2 s") as e:
        join_within(context, 2.0, "the test's job")
    assert time.monotonic() - t0 < 30 and "\n" not in str(e.value)
    assert not any(p.is_alive() for p in context.processes)


def test_a_failed_measurement_is_one_line_with_its_error():
    from calibrate.device.peers import join_within
    context = _start(_fail, ())
    with pytest.raises(UserError, match="the test's job failed: .*NCCL error: unhandled system error") as e:
        join_within(context, 60.0, "the test's job")
    assert "\n" not in str(e.value)


def test_a_measurement_that_finishes_returns():
    from calibrate.device.peers import join_within
    join_within(_start(_sleep, (0.1,)), 60.0, "the test's job")
