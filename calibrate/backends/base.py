"""The backend interface: one collective on one communicator, timed three ways
and checked on fresh random data.

A backend is built collectively on every rank of an mpi4py communicator (the
group being measured). ``measure`` returns one sample per timed unit, already
reduced to the maximum over ranks (a collective is as slow as its slowest rank):
- ``host``: ``iters`` back-to-back calls timed with a CPU clock and one sync, the
  sample being the mean per call of that batch (nccl-tests' default);
- ``graph``: the ``iters`` calls captured in a CUDA graph, replayed and timed with
  CUDA events, the sample being the mean per call (nccl-tests -G; GPU only);
- ``isolated``: barrier, one call, sync, per call (OSU-style); one sample per call.
Host and graph modes give ``reps`` samples, isolated mode ``iters``. In host and graph
modes a batch can be lengthened to a least duration (``Backend.batch_iters``).
"""
from __future__ import annotations

import contextlib
import math
import time
from abc import ABC, abstractmethod

import numpy as np

from calibrate.collectives import Collective
from calibrate.errors import OptionError
from calibrate.registry import NamedEnum
from calibrate.device.dtypes import tolerance
from calibrate.sizes import align


PROBE_CALLS = 4          # calls of the probe batch that sets the batch length (``Backend.batch_iters``)
MAX_BATCH_ITERS = 4096  # most calls per batch


class TimingMode(NamedEnum):
    __what__ = "timing mode"

    HOST = "host"
    GRAPH = "graph"
    ISOLATED = "isolated"


def buffer_lengths(coll: Collective, count_total: int, p: int) -> tuple[int, int]:
    """(send, recv) element counts for a whole buffer of ``count_total`` elements."""
    per_rank = count_total // p
    if coll is Collective.ALLGATHER:
        return per_rank, count_total
    if coll is Collective.REDUCESCATTER:
        return count_total, per_rank
    return count_total, count_total


def expected_output(xp, coll: Collective, inputs: list, rank: int):
    """The result rank ``rank`` must hold, from every rank's input (root 0, ring shift +1)."""
    p = len(inputs)
    if coll is Collective.ALLREDUCE:
        return sum(inputs[1:], inputs[0].copy())
    if coll is Collective.ALLGATHER:
        return xp.concatenate(inputs)
    if coll is Collective.REDUCESCATTER:
        n = len(inputs[0]) // p
        return sum(inputs[1:], inputs[0].copy())[rank * n:(rank + 1) * n]
    if coll is Collective.ALLTOALL:
        n = len(inputs[0]) // p
        return xp.concatenate([x[rank * n:(rank + 1) * n] for x in inputs])
    if coll is Collective.BROADCAST:
        return inputs[0].copy()
    return inputs[(rank - 1) % p].copy()


class Backend(ABC):
    """Times and checks collectives on one communicator. Subclasses launch the calls."""

    name = ""
    supports_graph = False

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    # -- what a backend provides ------------------------------------------------------
    @abstractmethod
    def buffers(self, coll: Collective, nbytes: int, dtype: str):
        """(send, recv) arrays for this size, allocated once and reused."""

    @abstractmethod
    def launch(self, coll: Collective, send, recv, dtype: str) -> None:
        """Start one collective (asynchronous on GPUs)."""

    def time_batch(self, coll: Collective, send, recv, dtype: str, iters: int, mode: TimingMode) -> list[float]:
        """Seconds per call of this rank: one value per batch (host, graph) or per call (isolated).
        Host and isolated here, for every backend; a backend with ``supports_graph`` adds graph."""
        if mode is TimingMode.ISOLATED:
            out = []
            for _ in range(iters):
                self.comm.Barrier()
                t0 = time.perf_counter()
                self.launch(coll, send, recv, dtype)
                self.synchronize()
                out.append(time.perf_counter() - t0)
            return out
        if mode is TimingMode.GRAPH:
            raise OptionError("mode", f"graph: the {self.name} backend has no graph timing; use host or isolated")
        self.synchronize()
        self.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            self.launch(coll, send, recv, dtype)
        self.synchronize()
        return [(time.perf_counter() - t0) / iters]

    @abstractmethod
    def fill_random(self, arr, seed: int) -> None:
        """Fill ``arr`` with reproducible random data of its dtype (no zeros)."""

    @abstractmethod
    def to_float64(self, arr, dtype: str):
        """``arr`` (stored as ``dtype``) converted to float64 in the same memory space."""

    def count_wrong(self, recv, expected, dtype: str) -> int:
        """Elements of ``recv`` that differ from the float64 ``expected`` beyond rounding."""
        xp = self.xp
        if recv.size != expected.size:
            return max(recv.size, expected.size)
        got = self.to_float64(recv, dtype)
        ok = xp.abs(got - expected) <= tolerance(dtype, self.size) * xp.abs(expected)
        return int(xp.count_nonzero(~ok))

    @abstractmethod
    def host_array(self, n: int, dtype: str, seed: int):
        """A fresh random array of ``n`` elements in the backend's memory (for references)."""

    def versions(self) -> dict:
        return {}

    # -- shared logic -------------------------------------------------------------------
    def aligned(self, coll: Collective, nbytes: int, dtype: str) -> tuple[int, int]:
        return align(coll, nbytes, self.size, dtype)

    def measure(self, coll: Collective | str, nbytes: int, dtype: str = "float32", iters: int = 20,
                warmup: int = 5, mode: TimingMode | str = TimingMode.HOST, reps: int = 5,
                min_batch_s: float = 0.0) -> np.ndarray:
        """Samples in seconds per call, each the maximum over ranks. With ``min_batch_s``, a batch
        (host, graph) holds at least ``iters`` calls and at least that many seconds of them
        (``batch_iters``)."""
        coll = Collective.parse(coll) if isinstance(coll, str) else coll
        mode = TimingMode.parse(mode) if isinstance(mode, str) else mode
        if mode is TimingMode.GRAPH and not self.supports_graph:
            raise OptionError("mode", f"graph needs GPUs: use {{backend}} nccl, or host or isolated with {self.name}")
        if iters < 1 or warmup < 0 or reps < 1:
            raise OptionError("iters", "and {reps} must be at least 1 and {warmup} at least 0")
        nbytes, _ = self.aligned(coll, nbytes, dtype)
        send, recv = self.buffers(coll, nbytes, dtype)
        with self.context():
            self.fill_random(send, seed=1000 + self.rank)
        self.synchronize()
        if warmup:
            self.time_batch(coll, send, recv, dtype, warmup, TimingMode.HOST)
        if min_batch_s > 0 and mode is not TimingMode.ISOLATED:
            iters = self.batch_iters(coll, send, recv, dtype, iters, min_batch_s)
        if mode is TimingMode.ISOLATED:
            local = self.time_batch(coll, send, recv, dtype, iters, mode)
        else:
            local = [self.time_batch(coll, send, recv, dtype, iters, mode)[0] for _ in range(reps)]
        return self.max_over_ranks(np.asarray(local, dtype=float))

    def batch_iters(self, coll: Collective, send, recv, dtype: str, iters: int, min_batch_s: float) -> int:
        """Calls per timed batch: ``iters``, or the power of two that makes a batch last at least
        ``min_batch_s``, whichever is more (at most ``MAX_BATCH_ITERS``).

        A batch starts when the ranks leave a barrier, a few microseconds apart, and
        the first call waits for the last rank: that skew, and the launch of the
        batch, are in every sample. Over 20 calls of 7 us they are several percent
        of the sample and vary from one sample to the next; spread over a
        millisecond of calls they are a fraction of a percent. The per-call time
        comes from a probe batch (host-timed, after the warmup, so a first call's
        set-up is not in it), the slowest rank's; a power of two keeps the count the
        same over a range of sizes, and every rank uses the same count."""
        probe = self.time_batch(coll, send, recv, dtype, PROBE_CALLS, TimingMode.HOST)[0]
        per_call = float(self.max_over_ranks(np.asarray([probe], dtype=float))[0])
        if per_call <= 0 or per_call * iters >= min_batch_s:
            return iters
        need = min_batch_s / per_call
        return int(min(max(iters, 2 ** math.ceil(math.log2(need))), MAX_BATCH_ITERS))

    def max_over_ranks(self, local: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        out = np.empty_like(local)
        self.comm.Allreduce(local, out, op=MPI.MAX)
        return out

    def check(self, coll: Collective | str, nbytes: int, dtype: str = "float32", seed: int = 0) -> int:
        """Run once on fresh random data (recv poisoned first); wrong elements summed over ranks."""
        from mpi4py import MPI

        coll = Collective.parse(coll) if isinstance(coll, str) else coll
        nbytes, _ = self.aligned(coll, nbytes, dtype)
        send, recv = self.buffers(coll, nbytes, dtype)
        with self.context():  # data preparation ordered with the collective's stream
            inputs = [self.host_array(len(send), dtype, seed * 7919 + r + 1) for r in range(self.size)]
            send[...] = inputs[self.rank]
            self.poison(recv)
            self.launch(coll, send, recv, dtype)
            self.synchronize()
            expected = expected_output(self.xp, coll, [self.to_float64(x, dtype) for x in inputs], self.rank)
            wrong = self.count_wrong(recv, expected, dtype)
        return int(self.comm.allreduce(wrong, op=MPI.SUM))

    @property
    @abstractmethod
    def xp(self):
        """The array module (numpy or cupy)."""

    @abstractmethod
    def poison(self, arr) -> None:
        """Overwrite ``arr`` with values no collective produces."""

    def synchronize(self) -> None:
        """Wait for the launched work (no-op on the host)."""

    def close(self) -> None:
        """Release the backend's resources; collective: every rank of the group calls it together."""

    def context(self):
        """A context in which array operations run in order with ``launch`` (a CUDA stream)."""
        return contextlib.nullcontext()
