"""The groups a calibration measures: the whole world and one group per network tier.

- ``world``: every rank;
- ``intra``: the ranks of one host (one group per host, measured concurrently,
  like nccl-tests' NCCL_TESTS_SPLIT; ``calibrate run`` starts every timed batch
  of the groups of a kind at one barrier of the world);
- ``inter``: one rank per host (the i-th rank of every host forms group i);
- ``pairs``: groups of 2 inside a host (local ranks 2i and 2i + 1; measured
  concurrently, as the tensor-parallel groups of 2 on a node of 4 run), beside
  the world, so that the profile holds a fit per group size (p = 2 and p = 4)
  and the cost model prices a group of 2 from its own measurements.
Each group is labelled with its tier: intra when it lies in one node, else inter.
``sleeping_barrier``: a barrier whose waiting ranks sleep instead of spinning (for
nodes emulated on one machine, whose ranks share its cores: the groups of one
node are then timed one node at a time, the others asleep).
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from calibrate.errors import OptionError, UserError

GROUP_KINDS = ("world", "intra", "inter", "pairs")


@dataclass(frozen=True)
class GroupInfo:
    kind: str          # world, intra or inter
    index: int         # which group of that kind this rank belongs to
    ranks: int         # ranks in the group
    nodes: int         # hosts the group spans
    tier: str          # intra or inter

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.ranks}x{self.nodes}"


def parse_group_kinds(text: str) -> list[str]:
    kinds = [k.strip().lower() for k in text.split(",") if k.strip()]
    for k in kinds:
        if k not in GROUP_KINDS:
            raise UserError(f"unknown group {k!r}: choose from {', '.join(GROUP_KINDS)}")
    if not kinds:
        raise OptionError("groups", "is empty: give world, intra, inter and/or pairs")
    return kinds


def topology(world) -> tuple[int, int, int, list[str]]:
    """(node index of this rank, number of nodes, local rank, host of every rank)."""
    hosts = world.allgather(socket.gethostname())
    order = list(dict.fromkeys(hosts))
    node = order.index(hosts[world.Get_rank()])
    local_rank = sum(1 for h in hosts[: world.Get_rank()] if h == hosts[world.Get_rank()])
    return node, len(order), local_rank, hosts


def split(world, kind: str):
    """(sub-communicator, GroupInfo) for this rank; None where the group has one rank."""
    node, nnodes, local_rank, hosts = topology(world)
    if kind == "world":
        comm, index = world.Dup(), 0
    elif kind == "intra":
        comm, index = world.Split(color=node, key=world.Get_rank()), node
    elif kind == "pairs":
        index = local_rank // 2
        comm = world.Split(color=node * world.Get_size() + index, key=world.Get_rank())
    else:
        comm, index = world.Split(color=local_rank, key=world.Get_rank()), local_rank
    members = comm.allgather(world.Get_rank())
    nodes = len({hosts[r] for r in members})
    sizes = world.allgather(comm.Get_size())
    info = GroupInfo(kind, index, comm.Get_size(), nodes, "intra" if nodes == 1 else "inter")
    if min(sizes) < 2 or len(set(sizes)) != 1:
        comm.Free()
    if len(set(sizes)) != 1 and kind == "pairs":
        raise UserError("the pairs groups need an even number of ranks on every node: start one more rank per "
                        "node or leave pairs out of --groups")
    if min(sizes) < 2:
        return None, info
    if len(set(sizes)) != 1:
        raise UserError(
            f"the {kind} groups have different sizes {sorted(set(sizes))}: "
            f"start the same number of ranks on every node"
        )
    return comm, info


def sleeping_barrier(comm, poll_s: float = 2e-4) -> None:
    """A barrier on ``comm`` whose ranks sleep ``poll_s`` between tests of it instead of spinning in MPI's
    progress loop, leaving the cores to the ranks still at work. Short: in ``calibrate run`` on network
    namespaces the working node's collectives waited a few of the sleepers' polls (a 2-rank allgather of
    8 KiB to 2 MiB in shared memory: 3-10 ms at a 1 ms poll, 10-53 ms at 5 ms, 0.5-2.4 ms at 0.2 ms; the
    cause is not found, and autotune validate's loop does not show it)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)
