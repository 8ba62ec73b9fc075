"""The NCCL backend: device (cupy) buffers, NCCL through the device layer.

One world communicator carries point-to-point sends and receives; every broadcast chain and every all-gather
group of the plan gets its own NCCL communicator (created in ``prepare``, in the same sorted order on all ranks,
its unique id handed out over MPI by the group's first member). A broadcast runs as one ncclBroadcast over the
chain's communicator: NCCL's ring broadcast pipelines the buffer in chunks itself, so the plan's K is not used
here. All NCCL calls go on one stream per rank; a wave of the plan's transfers is one NCCL group, its collectives
after it. The GPU is chosen from the node-local rank; two ranks on one GPU are refused.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from calibrate.device import nccl as device_nccl
from calibrate.device.dtypes import DTYPES, EXTRA_DTYPES
from calibrate.device.gpu import cupy_or_error, select_gpu
from calibrate.errors import UserError
from kernels.reshard.program import Backend
from kernels.reshard.strategies import groups

_MOVABLE = {name: d for name, d in {**DTYPES, **EXTRA_DTYPES}.items() if name != "bfloat16"}


def _nccl_dtype(dtype) -> int:
    d = _MOVABLE.get(np.dtype(dtype).name)
    if d is None:
        raise UserError(f"the NCCL backend cannot move {np.dtype(dtype).name}: use one of {', '.join(_MOVABLE)}")
    return d.nccl


class NCCLBackend(Backend):
    asynchronous = True

    def __init__(self, comm=None):
        self.xp = cupy = cupy_or_error("the NCCL resharding backend")
        self.comm = comm or MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.device = self.rank
        select_gpu(self.comm, needs="the NCCL resharding backend", fallback="use the mpi backend")
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()  # cupy's copies and NCCL's transfers share this one stream, hence its order
        self.world = device_nccl.communicator(self.comm)
        self.groups: dict[tuple[int, ...], object] = {}
        self._after: list | None = None  # the collectives of the open group (``group``); None: none open

    def close(self) -> None:
        """Destroy every NCCL communicator, all ranks together (collective over ``comm``)."""
        device_nccl.destroy(self.comm, self.stream, list(self.groups.values()) + [self.world])
        self.groups.clear()

    def prepare(self, plan):
        for g in sorted(groups(plan)):
            if len(g) > 1 and self.device in g and g not in self.groups:
                self.groups[g] = device_nccl.communicator(self.comm, members=g)

    def send(self, buf, peer, tag):
        self.world.send(buf.data.ptr, buf.size, _nccl_dtype(buf.dtype), peer, self.stream.ptr)

    def recv(self, buf, peer, tag):
        self.world.recv(buf.data.ptr, buf.size, _nccl_dtype(buf.dtype), peer, self.stream.ptr)

    def ring_broadcast(self, buf, chain, partitions, tag):
        if len(chain) < 2:
            return
        self._issue(lambda: self.groups[chain].broadcast(buf.data.ptr, buf.data.ptr, buf.size,
                                                         _nccl_dtype(buf.dtype), 0, self.stream.ptr))

    def allgather(self, buf, group, part, tag):
        if len(group) < 2:
            return
        i = group.index(self.device)
        self._issue(lambda: self.groups[group].allGather(buf[i * part:(i + 1) * part].data.ptr, buf.data.ptr, part,
                                                         _nccl_dtype(buf.dtype), self.stream.ptr))

    def _issue(self, collective) -> None:
        """A collective now, or inside a group after its transfers (``group``)."""
        if self._after is None:
            collective()
        else:
            self._after.append(collective)

    @contextmanager
    def group(self):
        """The point-to-point transfers inside it in one NCCL group over the world communicator; its collectives
        (each on its own communicator) after it, one by one in the order called, which is the plan's on every rank:
        communicators grouped together could be launched in different orders on the ranks' streams."""
        from cupy.cuda import nccl

        self._after = []
        try:
            nccl.groupStart()
            try:
                yield
            finally:
                nccl.groupEnd()
            for collective in self._after:
                collective()
        finally:
            self._after = None

    def synchronize(self):
        self.stream.synchronize()
