"""NCCL communicators over MPI, and one launch of each collective.

    comm = communicator(mpi_comm)                  # all ranks of mpi_comm
    sub = communicator(mpi_comm, members=(0, 2))   # called by exactly those ranks
    launch(comm, Collective.ALLREDUCE, send_ptr, recv_ptr, count, "float32", rank, nranks, stream.ptr)
    destroy(mpi_comm, stream, [sub, comm])         # every rank of mpi_comm, together

``count`` follows NCCL: elements of the whole buffer for allreduce, broadcast,
alltoall and sendrecv, of one rank's part for allgather (its input) and
reducescatter (its output). Alltoall is grouped sends and receives, sendrecv a
grouped ring shift (+1). A communicator left to garbage collection at exit can
hang: one rank may never destroy it while another waits for it in
ncclCommDestroy; ``destroy`` is the explicit, collective end. Every CUDA graph that
captured a call on a communicator must be destroyed before it: ncclCommDestroy
(NCCL >= 2.26) waits until no graph holds a call on it, and never returns otherwise.
"""
from __future__ import annotations

from calibrate.collectives import Collective
from calibrate.device.dtypes import DTYPES, EXTRA_DTYPES, dtype_info
from calibrate.device.gpu import cupy_or_error
from calibrate.errors import UserError

_TAG = 7001
NCCL_SUM = 0


def nccl_module(needs: str = "NCCL"):
    cupy_or_error(needs)
    from cupy.cuda import nccl

    return nccl


def communicator(mpi_comm, members: tuple[int, ...] | None = None, needs: str = "NCCL",
                 min_ctas: int | None = None):
    """An NCCL communicator over ``members`` (ranks of ``mpi_comm``; all of them when None).

    Called by exactly the members; the unique id comes from the first one, broadcast
    over ``mpi_comm`` (all ranks) or sent to each other member. ``min_ctas``: a
    communicator of at least that many channels (``calibrate.device.nccl_config``;
    all ranks of ``mpi_comm`` only), as NCCL_MIN_CTAS would make it.
    """
    nccl = nccl_module(needs)
    if min_ctas is not None:
        if members is not None:
            raise UserError("a channel configuration is for communicators over all ranks of the MPI communicator")
        from calibrate.device.nccl_config import Library

        return Library(nccl).communicator(mpi_comm, min_ctas)
    rank = mpi_comm.Get_rank()
    if members is None:
        uid = nccl.get_unique_id() if rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        return nccl.NcclCommunicator(mpi_comm.Get_size(), uid, rank)
    first = members[0]
    if rank == first:
        uid = nccl.get_unique_id()
        for r in members[1:]:
            mpi_comm.send(uid, dest=r, tag=_TAG)
    else:
        uid = mpi_comm.recv(source=first, tag=_TAG)
    return nccl.NcclCommunicator(len(members), uid, members.index(rank))


def destroy(mpi_comm, stream, comms) -> None:
    """Destroy ``comms`` (this rank's NCCL communicators) on every rank of ``mpi_comm`` at once."""
    stream.synchronize()
    mpi_comm.Barrier()
    for c in comms:
        c.destroy()


def launch(comm, coll: Collective, sptr: int, rptr: int, count: int, dtype: str, rank: int, nranks: int,
           stream_ptr: int) -> None:
    """Start one collective on ``stream_ptr`` (NCCL's ``count`` convention, see above)."""
    from cupy.cuda import nccl

    info = dtype_info(dtype, {**DTYPES, **EXTRA_DTYPES})
    t, s = info.nccl, stream_ptr
    if coll is Collective.ALLREDUCE:
        comm.allReduce(sptr, rptr, count, t, NCCL_SUM, s)
    elif coll is Collective.ALLGATHER:
        comm.allGather(sptr, rptr, count, t, s)
    elif coll is Collective.REDUCESCATTER:
        comm.reduceScatter(sptr, rptr, count, t, NCCL_SUM, s)
    elif coll is Collective.BROADCAST:
        comm.broadcast(sptr, rptr, count, t, 0, s)
    elif coll is Collective.ALLTOALL:
        n = count // nranks
        step = n * info.bytes
        nccl.groupStart()
        for peer in range(nranks):
            comm.send(sptr + peer * step, n, t, peer, s)
            comm.recv(rptr + peer * step, n, t, peer, s)
        nccl.groupEnd()
    else:
        nccl.groupStart()
        comm.send(sptr, count, t, (rank + 1) % nranks, s)
        comm.recv(rptr, count, t, (rank - 1) % nranks, s)
        nccl.groupEnd()
