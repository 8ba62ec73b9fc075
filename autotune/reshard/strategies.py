"""Strategies for one unit communication task (§3.1) as the planner costs them, behind
one registry (the executor runs them by the same names: ``kernels.reshard.strategies``).

Each strategy turns a unit task into jobs: schedulable communications with one
option per candidate sender device (duration and ports under the network model
of ``network.py``). In the paper's terms, with t the time to move the slice
between two hosts, A receiver hosts and B receiver devices per host:

- send_recv: the sender sends the whole slice to each receiver device, one by
  one (A*B*t for one sender); one job per receiver host so that different
  receiver hosts may be served by different senders.
- local_allgather: the sender sends 1/B of the slice to each of the B devices
  of a receiver host, which all-gather it on the intra tier (A*t).
- global_allgather: the sender scatters 1/(A*B) to every receiver device, then
  all receivers all-gather the slice (about 2t).
- broadcast: a ring broadcast from the sender through all receivers, host by
  host, pipelined in K partitions: with hop times h_j(n/K),
  T(K) = sum_j h_j(n/K) + (K-1) * max_j h_j(n/K)  (the paper's t + A*t/K when
  alpha is 0); K is the power of two up to 1024 that minimises T.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autotune.reshard.network import Network, Port
from kernels.reshard.strategies import broadcast_chain
from kernels.reshard.tasks import UnitTask

MAX_PARTITIONS = 1024


@dataclass(frozen=True)
class Option:
    sender: int
    duration: float
    ports: frozenset[Port] = field(compare=False)
    partitions: int = 1


@dataclass(frozen=True)
class Job:
    task: int
    strategy: str
    receivers: tuple[int, ...]
    options: tuple[Option, ...]
    nbytes: int


def _by_host(net: Network, devices) -> dict[int, tuple[int, ...]]:
    out: dict[int, list[int]] = {}
    for d in sorted(devices):
        out.setdefault(net.host(d), []).append(d)
    return {h: tuple(v) for h, v in out.items()}


class Strategy:
    name = ""

    def jobs(self, unit: UnitTask, net: Network) -> list[Job]:
        raise NotImplementedError

    def _job(self, unit: UnitTask, receivers: tuple[int, ...], options: list[Option]) -> Job:
        return Job(unit.index, self.name, receivers, tuple(options), unit.nbytes)


class SendRecv(Strategy):
    name = "send_recv"

    def jobs(self, unit, net):
        out = []
        for recv in _by_host(net, unit.receivers).values():
            opts = []
            for s in unit.senders:
                transfers = [(s, d) for d in recv if d != s]
                dur = sum(net.hop(unit.nbytes, a, b) for a, b in transfers)
                opts.append(Option(s, dur, net.ports(transfers, (s, *recv))))
            out.append(self._job(unit, recv, opts))
        return out


def _allgather_options(unit, recv, net) -> list:
    """One option per sender: scatter 1/len(recv) of the slice to each receiver, then all-gather among them."""
    part = unit.nbytes / len(recv)
    opts = []
    for s in unit.senders:
        transfers = [(s, d) for d in recv if d != s]
        dur = sum(net.hop(part, a, b) for a, b in transfers) + net.allgather(unit.nbytes, recv)
        opts.append(Option(s, dur, net.ports(transfers + net.ring(recv), (s, *recv))))
    return opts


class LocalAllGather(Strategy):
    name = "local_allgather"

    def jobs(self, unit, net):
        out = []
        for recv in _by_host(net, unit.receivers).values():
            out.append(self._job(unit, recv, _allgather_options(unit, recv, net)))
        return out


class GlobalAllGather(Strategy):
    name = "global_allgather"

    def jobs(self, unit, net):
        recv = tuple(sorted(unit.receivers))
        return [self._job(unit, recv, _allgather_options(unit, recv, net))]


def pipelined_time(net: Network, chain: list[int], nbytes: float, k: int) -> float:
    hops = [net.hop(nbytes / k, a, b) for a, b in zip(chain, chain[1:])]
    return sum(hops) + (k - 1) * max(hops) if hops else 0.0


def best_partitions(net: Network, chain: list[int], nbytes: float) -> tuple[int, float]:
    best = (1, pipelined_time(net, chain, nbytes, 1))
    k = 2
    while k <= MAX_PARTITIONS and len(chain) > 2:
        t = pipelined_time(net, chain, nbytes, k)
        if t < best[1]:
            best = (k, t)
        k *= 2
    return best


class Broadcast(Strategy):
    name = "broadcast"

    def jobs(self, unit, net):
        recv = tuple(sorted(unit.receivers))
        opts = []
        for s in unit.senders:
            chain = broadcast_chain(net.devices_per_host, s, recv)
            k, dur = best_partitions(net, chain, unit.nbytes)
            opts.append(Option(s, dur, net.ports(list(zip(chain, chain[1:])), (s, *recv)), k))
        return [self._job(unit, recv, opts)]


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SendRecv, LocalAllGather, GlobalAllGather, Broadcast)
}
