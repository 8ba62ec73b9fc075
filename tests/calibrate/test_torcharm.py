"""The torch arm's batches as a step runs its calls: the first timed call of a batch does not pay for the
device being idle when the batch starts."""
import time

import pytest

torch = pytest.importorskip("torch")

from calibrate.measure.torcharm import TorchArm, medians, timing  # noqa: E402


class IdleStart(TorchArm):
    """A stand-in device whose first call after a synchronisation waits 20 ms (a launch on an idle device);
    every other call takes 2 ms."""

    def __init__(self):
        self.idle = True
        super().__init__(torch, "cpu", self._call)

    def _call(self, i):
        time.sleep(0.022 if self.idle else 0.002)
        self.idle = False

    def synchronize(self) -> None:
        self.idle = True


def test_a_batch_starting_on_an_idle_device_times_its_calls_as_in_a_step():
    t = medians(torch, [("call", IdleStart)], timing(6, 1, back_to_back=True, rounds=3))["call"]
    # two calls a batch: with the idle start timed, the mean call would be (22 + 2) / 2 = 12 ms
    assert t == pytest.approx(0.002, abs=0.0015)
