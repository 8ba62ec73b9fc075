"""The MPI backend: mpi4py collectives on host (numpy) buffers. Runs anywhere."""
from __future__ import annotations


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
        c, p, r = self.comm, self.size, self.rank
        if coll is Collective.ALLREDUCE:
            c.Allreduce(send, recv, op=MPI.SUM)
        elif coll is Collective.ALLGATHER:
            c.Allgather(send, recv)
        elif coll is Collective.REDUCESCATTER:
            c.Reduce_scatter_block(send, recv, op=MPI.SUM)
        elif coll is Collective.ALLTOALL:
            c.Alltoall(send, recv)
        elif coll is Collective.BROADCAST:
            if r == 0:
                recv[...] = send
            c.Bcast(recv, root=0)
        else:
            c.Sendrecv(send, dest=(r + 1) % p, recvbuf=recv, source=(r - 1) % p)

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
