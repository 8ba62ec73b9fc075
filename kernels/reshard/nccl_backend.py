"""The NCCL backend: device (cupy) buffers, NCCL through ``cupy.cuda.nccl``.

One world communicator carries point-to-point sends and receives; every
broadcast chain and every all-gather group of the plan gets its own NCCL
communicator (created in ``prepare``, in the same sorted order on all ranks, its
unique id handed out over MPI by the group's first member). A broadcast runs as
one ncclBroadcast over the chain's communicator: NCCL's ring broadcast pipelines
the buffer in chunks itself, so the plan's K is not used here. All NCCL calls go
on one stream per rank, so the jobs of a rank run in plan order.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from autotune.reshard.strategies import broadcast_chain
from calibrate.errors import UserError
from kernels.reshard.program import Backend

try:
    import cupy
    from cupy.cuda import nccl
except ImportError:  # the class below says so when used
    cupy = None
    nccl = None


def _nccl_dtype(dtype) -> int:
    table = {"float32": "NCCL_FLOAT32", "float16": "NCCL_FLOAT16", "float64": "NCCL_FLOAT64",
             "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8", "int8": "NCCL_INT8"}
    name = table.get(np.dtype(dtype).name)
    if name is None:
        raise UserError(f"the NCCL backend cannot move {np.dtype(dtype).name}: use one of {', '.join(table)}")
    return getattr(nccl, name)


class NCCLBackend(Backend):
    def __init__(self, comm=None, gpu: int | None = None, device: int | None = None):
        if cupy is None:
            raise UserError("the NCCL backend needs cupy with NCCL (pip install cupy-cuda13x) and a GPU")
        self.xp = cupy
        self.comm = comm or MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.device = self.rank if device is None else device
        cupy.cuda.Device(self.rank % cupy.cuda.runtime.getDeviceCount() if gpu is None else gpu).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()  # cupy's copies and NCCL's transfers share this one stream, hence its order
        self.world = self._communicator(tuple(range(self.comm.Get_size())))
        self.groups: dict[tuple[int, ...], object] = {}

    def _communicator(self, members: tuple[int, ...]):
        """An NCCL communicator over the given ranks (called by exactly those ranks)."""
        first = members[0]
        if self.rank == first:
            uid = nccl.get_unique_id()
            for r in members[1:]:
                self.comm.send(uid, dest=r, tag=7001)
        else:
            uid = self.comm.recv(source=first, tag=7001)
        return nccl.NcclCommunicator(len(members), uid, members.index(self.rank))

    def close(self) -> None:
        """Destroy every NCCL communicator, all ranks together (collective over ``comm``).

        Left to garbage collection at exit, one rank may never destroy a
        communicator while a peer waits for it in ncclCommDestroy: a hang.
        """
        self.stream.synchronize()
        self.comm.Barrier()
        for c in list(self.groups.values()) + [self.world]:
            c.destroy()
        self.groups.clear()

    def prepare(self, plan):
        groups = set()
        for job in plan.jobs:
            if job.strategy == "broadcast":
                groups.add(tuple(broadcast_chain(plan.task.devices_per_host, job.sender, job.receivers)))
            elif job.strategy in ("local_allgather", "global_allgather"):
                groups.add(tuple(sorted(job.receivers)))
        for g in sorted(groups):
            if len(g) > 1 and self.device in g and g not in self.groups:
                self.groups[g] = self._communicator(g)

    def _dt(self, buf):
        return _nccl_dtype(buf.dtype)

    def send(self, buf, peer, tag):
        self.world.send(buf.data.ptr, buf.size, self._dt(buf), peer, self.stream.ptr)

    def recv(self, buf, peer, tag):
        self.world.recv(buf.data.ptr, buf.size, self._dt(buf), peer, self.stream.ptr)

    def ring_broadcast(self, buf, chain, partitions, tag):
        if len(chain) < 2:
            return
        self.groups[chain].broadcast(buf.data.ptr, buf.data.ptr, buf.size, self._dt(buf), 0, self.stream.ptr)

    def allgather(self, buf, group, part, tag):
        if len(group) < 2:
            return
        i = group.index(self.device)
        self.groups[group].allGather(buf[i * part:(i + 1) * part].data.ptr, buf.data.ptr, part, self._dt(buf),
                                     self.stream.ptr)

    def synchronize(self):
        self.stream.synchronize()
