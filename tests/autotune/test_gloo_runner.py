"""``run_on_gloo``: a run that hangs (a rank that never reaches the barrier the other waits in) ends within its
limit as a ``TimeoutError`` naming the ranks still running, instead of hanging the suite."""
import time

import pytest

pytest.importorskip("torch")
from gloo_runner import run_on_gloo  # noqa: E402


def _rank_one_hangs():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def test_a_hung_run_fails_within_its_limit():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"_rank_one_hangs on 2 gloo ranks: ranks \[0, 1\] still running after 5 s"):
        run_on_gloo(_rank_one_hangs, [()], 2, limit=5)
    assert time.monotonic() - start < 60
