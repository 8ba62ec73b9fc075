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
modes a batch can be lengthened to a least duration. The timing is the measurement engine's
(``calibrate.measure.engine``): ``Backend.arm`` is one collective as an arm of a comparison.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Callable

import numpy as np

from calibrate.collectives import Collective
from calibrate.errors import OptionError, UserError
from calibrate.device.dtypes import tolerance
from calibrate.measure import engine
from calibrate.measure.engine import TimingMode
from calibrate.sizes import align


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
        # where every timed batch starts: a barrier over this communicator (``engine.MpiGroup``'s start);
        # the caller sets a wider one when other groups are measured at the same time
        self.start_comm = None
        # a rank waiting for its collective gives its core to the others (sched_yield) instead of spinning: set by
        # the caller where ranks outnumber the cores they share (--nodes-share-cores; a backend whose waits spin on
        # the host honours it, mpi)
        self.yield_while_waiting = False

    # -- what a backend provides ------------------------------------------------------
    @abstractmethod
    def buffers(self, coll: Collective, nbytes: int, dtype: str):
        """(send, recv) arrays for this size, allocated once and reused."""

    @abstractmethod
    def launch(self, coll: Collective, send, recv, dtype: str) -> None:
        """Start one collective (asynchronous on GPUs)."""

    def graph_timer(self, call: Callable[[], None], calls: int) -> Callable[[], float]:
        """``calls`` calls of ``call`` captured once in a CUDA graph: a function that replays it and
        returns the seconds of the replay (a backend with ``supports_graph`` provides it)."""
        raise OptionError("mode", f"graph: the {self.name} backend has no graph timing; use host or isolated")

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

    def arm(self, coll: Collective | str, nbytes: int, dtype: str = "float32") -> "CollectiveArm":
        """One collective of ``nbytes`` on this backend as an arm of ``calibrate.measure.engine.compare``."""
        coll = Collective.parse(coll) if isinstance(coll, str) else coll
        nbytes, _ = self.aligned(coll, nbytes, dtype)
        return CollectiveArm(self, coll, nbytes, dtype)

    def measure(self, coll: Collective | str, nbytes: int, dtype: str = "float32", iters: int = 20,
                warmup: int = 5, mode: TimingMode | str = TimingMode.HOST, reps: int = 5,
                min_batch_s: float = 0.0) -> np.ndarray:
        """Samples in seconds per call, each the maximum over ranks: the engine with this one arm,
        unchecked (``check`` is separate). With ``min_batch_s``, a batch (host, graph) holds at least
        ``iters`` calls and at least that many seconds of them."""
        mode = TimingMode.parse(mode) if isinstance(mode, str) else mode
        if mode is TimingMode.GRAPH and not self.supports_graph:
            raise OptionError("mode", f"graph needs GPUs: use {{backend}} nccl, or host or isolated with {self.name}")
        if iters < 1 or warmup < 0 or reps < 1:
            raise OptionError("iters", "and {reps} must be at least 1 and {warmup} at least 0")
        isolated = mode is TimingMode.ISOLATED
        opts = engine.Options(mode, rounds=1 if isolated else reps, calls=iters, min_batch_s=min_batch_s,
                              warmup=warmup, check=False)
        res = engine.compare(engine.MpiGroup(self.comm, self.start_comm), [("this", lambda: self.arm(coll, nbytes, dtype))], opts)
        arm = res["this"]
        if not arm.ok:
            raise UserError(f"{self.name} {coll} {nbytes} B: {arm.reason}")
        return np.asarray(arm.samples_s, dtype=float)

    def check(self, coll: Collective | str, nbytes: int, dtype: str = "float32", seed: int = 0) -> int:
        """Run once on fresh random data (recv poisoned first); wrong elements summed over ranks."""
        from mpi4py import MPI

        return int(self.comm.allreduce(self.check_local(coll, nbytes, dtype, seed), op=MPI.SUM))

    def check_local(self, coll: Collective | str, nbytes: int, dtype: str = "float32", seed: int = 0) -> int:
        """``check`` on this rank: its wrong elements."""
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
            return int(self.count_wrong(recv, expected, dtype))

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


class CollectiveArm(engine.Arm):
    """One collective of one size on a backend's buffers; the backend stays its owner's (``own``:
    closed with the arm, for an arm that made its own communicator)."""

    def __init__(self, backend: Backend, coll: Collective, nbytes: int, dtype: str, own: bool = False):
        self.backend, self.coll, self.nbytes, self.dtype, self.own = backend, coll, nbytes, dtype, own
        self.send, self.recv = backend.buffers(coll, nbytes, dtype)
        with backend.context():
            backend.fill_random(self.send, seed=1000 + backend.rank)
        backend.synchronize()

    def call(self) -> None:
        self.backend.launch(self.coll, self.send, self.recv, self.dtype)

    def synchronize(self) -> None:
        self.backend.synchronize()

    def check(self, seed: int) -> int:
        wrong = self.backend.check_local(self.coll, self.nbytes, self.dtype, seed)
        self.send, self.recv = self.backend.buffers(self.coll, self.nbytes, self.dtype)
        return wrong

    def graph(self, calls: int) -> Callable[[], float]:
        return self.backend.graph_timer(self.call, calls)

    def close(self) -> None:
        if self.own:
            self.backend.close()
