"""A CPU stand-in for a GPU, so that the engine's device paths run without one.

``Device``: work launched on its stream is queued and runs when the stream is
synchronized (as a GPU runs it after the launch returns); a graph records the work
launched while capturing and replays it, timed by the host clock around the replay
and its synchronization (the events' part on a GPU). ``SumArm`` is a collective on it:
the sum over ranks of every rank's input (an allreduce through the group's MPI
communicator, or of one rank alone), with an optional planted fault.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from calibrate.measure.engine import Arm


class Device:
    def __init__(self):
        self._queue: list[Callable[[], None]] = []
        self._capture: list[Callable[[], None]] | None = None
        self.ran: list[str] = []          # the name given to each launch, in the order it ran

    def launch(self, fn: Callable[[], None]) -> None:
        (self._queue if self._capture is None else self._capture).append(fn)

    def synchronize(self) -> None:
        queue, self._queue = self._queue, []
        for fn in queue:
            fn()

    def capture(self, record: Callable[[], None]) -> list[Callable[[], None]]:
        """The work ``record()`` launches, kept instead of queued."""
        self.synchronize()
        self._capture = []
        try:
            record()
            return self._capture
        finally:
            self._capture = None

    def replay(self, graph: list[Callable[[], None]]) -> float:
        """Seconds to run ``graph`` to completion."""
        t0 = time.perf_counter()
        self._queue.extend(graph)
        self.synchronize()
        return time.perf_counter() - t0


class SumArm(Arm):
    """out = the sum over ranks of each rank's input, computed on the stand-in ``device``.

    ``comm``: an mpi4py communicator (None: one rank). ``fault_from``: from that call on (1 is the
    first call) the kernel adds 1 to the first element of its output, as a kernel that reuses
    stale state after its first call would. ``name`` labels the device's log of launches."""

    def __init__(self, device: Device, n: int, comm=None, fault_from: int = 0, name: str = "sum"):
        self.device, self.n, self.comm, self.fault_from, self.name = device, n, comm, fault_from, name
        self.rank = 0 if comm is None else comm.Get_rank()
        self.size = 1 if comm is None else comm.Get_size()
        self.send = self._input(0, self.rank)
        self.recv = np.empty(n)
        self.calls = 0

    def _input(self, seed: int, rank: int) -> np.ndarray:
        return np.random.default_rng([seed, rank]).uniform(0.5, 1.5, self.n)

    def _kernel(self) -> None:
        self.calls += 1
        self.device.ran.append(self.name)
        if self.comm is None:
            self.recv[...] = self.send
        else:
            from mpi4py import MPI

            self.comm.Allreduce(self.send, self.recv, op=MPI.SUM)
        if self.fault_from and self.calls >= self.fault_from:
            self.recv[0] += 1.0

    def call(self) -> None:
        self.device.launch(self._kernel)

    def synchronize(self) -> None:
        self.device.synchronize()

    def check(self, seed: int) -> int:
        self.send[...] = self._input(seed, self.rank)
        self.recv[...] = np.nan
        self.call()
        self.synchronize()
        want = sum(self._input(seed, r) for r in range(self.size))
        return int(np.count_nonzero(~(np.abs(self.recv - want) <= 1e-12 * np.abs(want))))

    def graph(self, calls: int) -> Callable[[], float]:
        graph = self.device.capture(lambda: [self.call() for _ in range(calls)])
        return lambda: self.device.replay(graph)
