"""The NCCL backend: cupy.cuda.nccl on device buffers, one process per GPU.

The GPU, the NCCL communicator, the launch of each collective and the graph
timer come from the device layer (``calibrate.device``). bfloat16 buffers are
held as uint16 bit patterns (cupy has no bf16 type); their reference is computed
in float32 from the same bits.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from calibrate.backends.base import Backend, buffer_lengths
from calibrate.collectives import Collective
from calibrate.device import nccl as device_nccl
from calibrate.device.dtypes import DTYPES, dtype_size
from calibrate.device.gpu import device_name, select_gpu
from calibrate.device.timing import capture, time_graph

try:
    import cupy as cp
except ImportError:  # a machine without cupy: the error is raised when the backend is built
    cp = None


class NcclBackend(Backend):
    name = "nccl"
    supports_graph = True

    def __init__(self, comm, device: int | None = None, min_ctas: int | None = None):
        """``min_ctas``: a communicator of at least that many channels (None: NCCL's default)."""
        super().__init__(comm)
        self.device = select_gpu(MPI.COMM_WORLD) if device is None else device
        self.nccl = device_nccl.communicator(comm, needs="the nccl backend", min_ctas=min_ctas)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._cache: dict = {}
        self._graphs: dict = {}

    @property
    def xp(self):
        return cp

    def versions(self) -> dict:
        return {
            "nccl": device_nccl.nccl_module().get_version(),
            "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "driver": cp.cuda.runtime.driverGetVersion(),
            "gpu": device_name(cp, self.device),
            "gpu_bus_id": cp.cuda.runtime.deviceGetPCIBusId(self.device),
            "mpi": MPI.Get_library_version().strip().splitlines()[0],
        }

    def buffers(self, coll, nbytes, dtype):
        key = (coll, nbytes, dtype)
        if key not in self._cache:
            self._cache.clear()
            self._graphs.clear()
            n_send, n_recv = buffer_lengths(coll, nbytes // dtype_size(dtype), self.size)
            store = DTYPES[dtype].storage
            self._cache[key] = (cp.empty(n_send, store), cp.empty(n_recv, store))
        return self._cache[key]

    def launch(self, coll, send, recv, dtype):
        count = recv.size if coll is Collective.REDUCESCATTER else send.size
        device_nccl.launch(self.nccl, coll, send.data.ptr, recv.data.ptr, count, dtype, self.rank, self.size,
                           self.stream.ptr)

    def graph_timer(self, call, calls):
        graph = capture(self.stream, lambda s: call(), calls)
        self._graphs[len(self._graphs)] = graph   # released with the buffers it replays on
        return lambda: time_graph(cp, self.stream, graph, calls) * calls

    def synchronize(self):
        self.stream.synchronize()

    def context(self):
        return self.stream

    def close(self):
        """Destroy the NCCL communicator on every rank at once.

        Left to garbage collection at exit, one rank may never destroy its
        communicator while another waits for it in ncclCommDestroy: a hang.
        """
        self.stream.synchronize()
        self._graphs.clear()
        self._cache.clear()
        device_nccl.destroy(self.comm, self.stream, [self.nccl])

    def host_array(self, n, dtype, seed):
        rng = cp.random.default_rng(seed)
        if "int" in dtype:
            return rng.integers(1, 100, size=n, dtype=np.int64).astype(dtype)
        x = rng.uniform(0.5, 1.5, size=n, dtype=cp.float32 if dtype != "float64" else cp.float64)
        if dtype == "bfloat16":
            return (x.view(cp.uint32) >> 16).astype(cp.uint16)
        return x.astype(dtype)

    def fill_random(self, arr, seed):
        dtype = "bfloat16" if arr.dtype == cp.uint16 else str(arr.dtype)
        arr[...] = self.host_array(arr.size, dtype, seed)

    def poison(self, arr):
        if arr.dtype == cp.uint16:
            arr[...] = 0x7FC1  # a bf16 NaN
        elif arr.dtype.kind == "f":
            arr[...] = cp.nan
        else:
            arr[...] = cp.iinfo(arr.dtype).min

    def to_float64(self, arr, dtype):
        if dtype == "bfloat16":
            return (arr.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
        return arr.astype(cp.float64)
