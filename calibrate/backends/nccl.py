"""The NCCL backend: cupy.cuda.nccl on device buffers, one process per GPU.

The GPU is chosen from the node-local rank (``select_gpu``); the NCCL unique id
is broadcast over MPI; alltoall is grouped send/recv, sendrecv a grouped ring
shift. bfloat16 buffers are held as uint16 bit patterns (cupy has no bf16 type);
their reference is computed in float32 from the same bits.
"""
from __future__ import annotations

import socket

import numpy as np
from mpi4py import MPI

from calibrate.backends.base import Backend, TimingMode, buffer_lengths
from calibrate.collectives import Collective
from calibrate.errors import UserError
from calibrate.sizes import dtype_size

try:
    import cupy as cp
    from cupy.cuda import nccl
except ImportError:  # a machine without cupy: the error is raised when the backend is built
    cp = None
    nccl = None

_NCCL_TYPES = {"int8": 0, "int32": 2, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_STORAGE = {"bfloat16": "uint16"}


def select_gpu(world) -> int:
    """Pick this rank's GPU from its node-local rank; refuse two ranks on one GPU.

    Collective over ``world``. Returns the device index, already made current.
    """
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    problem = ""
    device = -1
    try:
        ndev = cp.cuda.runtime.getDeviceCount() if cp is not None else 0
    except Exception:  # noqa: BLE001  (no driver, no device: reported below)
        ndev = 0
    if cp is None:
        problem = "the nccl backend needs cupy (pip install -e '.[gpu]'); use --backend mpi on machines without GPUs"
    elif ndev == 0:
        problem = f"no GPU is visible on {socket.gethostname()}: use --backend mpi, or run on GPU nodes"
    elif ndev >= local_size:
        device = local_rank
    elif ndev == 1:
        device = 0  # one GPU visible per rank (e.g. Slurm --gpus-per-task): checked below
    else:
        problem = (f"{local_size} ranks on {socket.gethostname()} but only {ndev} GPUs: "
                   f"start one rank per GPU (--ntasks-per-node={ndev})")
    problems = [m for m in world.allgather(problem) if m]
    if problems:
        raise UserError(problems[0])
    cp.cuda.Device(device).use()
    bus = cp.cuda.runtime.deviceGetPCIBusId(device)
    ids = world.allgather((socket.gethostname(), bus))
    if len(set(ids)) != len(ids):
        raise UserError(
            "two ranks landed on the same GPU: start one rank per GPU "
            "(--ntasks-per-node equal to the GPUs per node, and --gpus-per-task=1 or none)"
        )
    return device


class NcclBackend(Backend):
    name = "nccl"
    supports_graph = True

    def __init__(self, comm, device: int | None = None):
        super().__init__(comm)
        self.device = select_gpu(MPI.COMM_WORLD) if device is None else device
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = comm.bcast(uid, root=0)
        self.nccl = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._cache: dict = {}
        self._graphs: dict = {}

    @property
    def xp(self):
        return cp

    def versions(self) -> dict:
        props = cp.cuda.runtime.getDeviceProperties(self.device)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return {
            "nccl": nccl.get_version(),
            "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "driver": cp.cuda.runtime.driverGetVersion(),
            "gpu": name,
            "gpu_bus_id": cp.cuda.runtime.deviceGetPCIBusId(self.device),
            "mpi": MPI.Get_library_version().strip().splitlines()[0],
        }

    def buffers(self, coll, nbytes, dtype):
        key = (coll, nbytes, dtype)
        if key not in self._cache:
            self._cache.clear()
            self._graphs.clear()
            n_send, n_recv = buffer_lengths(coll, nbytes // dtype_size(dtype), self.size)
            store = _STORAGE.get(dtype, dtype)
            self._cache[key] = (cp.empty(n_send, store), cp.empty(n_recv, store))
        return self._cache[key]

    def launch(self, coll, send, recv, dtype):
        s, r, p = self.stream.ptr, self.rank, self.size
        t = _NCCL_TYPES[dtype]
        c = self.nccl
        if coll is Collective.ALLREDUCE:
            c.allReduce(send.data.ptr, recv.data.ptr, send.size, t, nccl.NCCL_SUM, s)
        elif coll is Collective.ALLGATHER:
            c.allGather(send.data.ptr, recv.data.ptr, send.size, t, s)
        elif coll is Collective.REDUCESCATTER:
            c.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, t, nccl.NCCL_SUM, s)
        elif coll is Collective.BROADCAST:
            c.broadcast(send.data.ptr, recv.data.ptr, send.size, t, 0, s)
        elif coll is Collective.ALLTOALL:
            n = send.size // p
            step = n * send.itemsize
            nccl.groupStart()
            for peer in range(p):
                c.send(send.data.ptr + peer * step, n, t, peer, s)
                c.recv(recv.data.ptr + peer * step, n, t, peer, s)
            nccl.groupEnd()
        else:
            nccl.groupStart()
            c.send(send.data.ptr, send.size, t, (r + 1) % p, s)
            c.recv(recv.data.ptr, recv.size, t, (r - 1) % p, s)
            nccl.groupEnd()

    def _graph(self, coll, send, recv, dtype, iters):
        key = (coll, send.data.ptr, recv.data.ptr, dtype, iters)
        if key not in self._graphs:
            self.stream.begin_capture()
            for _ in range(iters):
                self.launch(coll, send, recv, dtype)
            self._graphs[key] = self.stream.end_capture()
            self._graphs[key].launch(self.stream)  # first replay uploads the graph
            self.stream.synchronize()
        return self._graphs[key]

    def time_batch(self, coll, send, recv, dtype, iters, mode):
        if mode is not TimingMode.GRAPH:
            return super().time_batch(coll, send, recv, dtype, iters, mode)
        graph = self._graph(coll, send, recv, dtype, iters)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        self.stream.synchronize()
        self.comm.Barrier()
        start.record(self.stream)
        graph.launch(self.stream)
        stop.record(self.stream)
        stop.synchronize()
        return [cp.cuda.get_elapsed_time(start, stop) * 1e-3 / iters]

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
        self.comm.Barrier()
        self.nccl.destroy()

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
