"""The collectives we time, with nccl-tests' size and bus-bandwidth conventions
and the ring coefficients of the alpha-beta model (AutoDDL Table 2).

Sizes follow nccl-tests' ``size`` column: the bytes of the larger of the send
and receive buffers of one rank, i.e. the whole buffer (allreduce: the vector;
allgather: the gathered output; reducescatter: the input; alltoall: the whole
send buffer; broadcast: the vector; sendrecv: the message).
"""
from __future__ import annotations

from calibrate.errors import UserError
from calibrate.registry import NamedEnum


class Collective(NamedEnum):
    __what__ = "collective"
    __aliases__ = {"p2p": "sendrecv"}

    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    REDUCESCATTER = "reducescatter"
    ALLTOALL = "alltoall"
    BROADCAST = "broadcast"
    SENDRECV = "sendrecv"


ALL_COLLECTIVES = tuple(Collective)


def busbw_factor(coll: Collective, p: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor."""
    if p < 1:
        raise UserError(f"group size must be at least 1, got {p}")
    if coll is Collective.ALLREDUCE:
        return 2.0 * (p - 1) / p
    if coll in (Collective.ALLGATHER, Collective.REDUCESCATTER, Collective.ALLTOALL):
        return (p - 1) / p
    return 1.0


def ring_coefficients(coll: Collective, p: int) -> tuple[float, float]:
    """(a, b) such that T(n) = a*alpha + b*n*beta for the ring algorithm.

    AutoDDL Table 2 for allreduce, allgather, reducescatter and alltoall, with n
    the whole buffer (nccl-tests' size). Broadcast is NCCL's pipelined ring: p-1
    hops of latency and the message crossing each link once; sendrecv is one
    message.
    """
    if p < 1:
        raise UserError(f"group size must be at least 1, got {p}")
    if coll is Collective.ALLREDUCE:
        return 2.0 * (p - 1), 2.0 * (p - 1) / p
    if coll in (Collective.ALLGATHER, Collective.REDUCESCATTER, Collective.ALLTOALL):
        return float(p - 1), (p - 1) / p
    if coll is Collective.BROADCAST:
        return float(max(p - 1, 1)), 1.0
    return 1.0, 1.0


def rank_divides(coll: Collective) -> bool:
    """Whether the element count of the whole buffer must be a multiple of p."""
    return coll in (Collective.ALLGATHER, Collective.REDUCESCATTER, Collective.ALLTOALL)
