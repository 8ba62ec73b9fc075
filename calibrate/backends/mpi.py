"""The MPI backend: mpi4py collectives on host (numpy) buffers. Runs anywhere."""
from __future__ import annotations

import os

import mpi4py
import numpy as np
from mpi4py import MPI

from calibrate.backends.base import Backend, buffer_lengths
from calibrate.collectives import Collective
from calibrate.device.dtypes import dtype_size
from calibrate.sizes import np_dtype


class MpiBackend(Backend):
    name = "mpi"
    supports_graph = False

    def __init__(self, comm):
        super().__init__(comm)
        self._cache: dict = {}

    @property
    def xp(self):
        return np

    def versions(self) -> dict:
        return {"mpi": MPI.Get_library_version().strip().splitlines()[0], "mpi4py": mpi4py.__version__}

    def buffers(self, coll, nbytes, dtype):
        key = (coll, nbytes, dtype)
        if key not in self._cache:
            self._cache.clear()  # one size at a time: keep memory to one buffer pair
            n_send, n_recv = buffer_lengths(coll, nbytes // dtype_size(dtype), self.size)
            self._cache[key] = (np.empty(n_send, np_dtype(dtype)), np.empty(n_recv, np_dtype(dtype)))
        return self._cache[key]

    def launch(self, coll, send, recv, dtype):
        """The blocking collective; with ``yield_while_waiting`` its nonblocking form, tested until done with
        the core given up between tests (``os.sched_yield``): on cores shared by more ranks than cores, a
        spinning rank holds its core until the scheduler's tick while the rank that has the next step waits."""
        c, p, r = self.comm, self.size, self.rank
        if coll is Collective.BROADCAST and r == 0:
            recv[...] = send
        name, args, kwargs = _call(coll, send, recv, p, r)
        if not self.yield_while_waiting:
            getattr(c, name)(*args, **kwargs)
            return
        request = getattr(c, "I" + name[0].lower() + name[1:])(*args, **kwargs)
        while not request.Test():
            os.sched_yield()

    def fill_random(self, arr, seed):
        arr[...] = self.host_array(len(arr), str(arr.dtype), seed)

    def host_array(self, n, dtype, seed):
        rng = np.random.default_rng(seed)
        if "int" in dtype:
            return rng.integers(1, 100, size=n).astype(np_dtype(dtype))
        return rng.uniform(0.5, 1.5, size=n).astype(np_dtype(dtype))

    def poison(self, arr):
        arr[...] = np.nan if arr.dtype.kind == "f" else np.iinfo(arr.dtype).min

    def to_float64(self, arr, dtype):
        return arr.astype(np.float64)


def _call(coll: Collective, send, recv, p: int, r: int) -> tuple[str, tuple, dict]:
    """The mpi4py method (blocking name; ``I`` + it is the nonblocking one) and its arguments for one collective."""
    if coll is Collective.ALLREDUCE:
        return "Allreduce", (send, recv), {"op": MPI.SUM}
    if coll is Collective.ALLGATHER:
        return "Allgather", (send, recv), {}
    if coll is Collective.REDUCESCATTER:
        return "Reduce_scatter_block", (send, recv), {"op": MPI.SUM}
    if coll is Collective.ALLTOALL:
        return "Alltoall", (send, recv), {}
    if coll is Collective.BROADCAST:
        return "Bcast", (recv,), {"root": 0}
    return "Sendrecv", (send,), {"dest": (r + 1) % p, "recvbuf": recv, "source": (r - 1) % p}
