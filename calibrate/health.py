"""Find the slow link or node of a cluster: time every node pair and every rank,
next to what a fitted profile expects, and name the outliers.

Measurements (``measure``, every rank of an MPI job, the same ranks on every node):

- per rank: each node's ranks in a ring, each sending ``nbytes`` to the next
  (``sendrecv``), every node at once; a rank's time against the intra tier's
  ``sendrecv`` at p = ranks per node;
- per node pair (``pairs``; every pair, in rounds of disjoint pairs so that a
  node carries one pair's traffic at a time): local rank k of node a exchanges
  ``nbytes`` with local rank k of node b, for every k at once, as the ``inter``
  groups of ``calibrate run`` are measured; against the inter tier's
  ``sendrecv`` at p = 2;
- halving (``halving``, for clusters too large for every pair): the nodes'
  ranks in one ring across all of them (local rank k of every node in a ring),
  then each half in its own ring, both halves at once, descending into every
  half that is slow; it finds slow nodes (a node's link slows every ring
  through it) in log2(nodes) rounds. A slow link between two healthy nodes
  slows only rings in which the two are neighbours: that is what ``pairs`` is for.

A time is an outlier when it is more than ``slow`` times the typical one (the
median of its kind, with at least 3 of them; else the profile's expected time)
and above the profile's expected time.
The suspects (``suspects``): a node whose every pair is slow (with 3 nodes or
more), each other slow pair, each slow rank, each smallest slow group of the
halving search. ``fraction`` = expected / measured: the share of the profile's
bandwidth the cluster delivers (1: as profiled; 0.25: four times slower).

The record (``HealthRecord``, kind ``commtune.health``) is versioned JSON,
written atomically and read back through a validating loader.
"""
from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from calibrate.collectives import Collective
from calibrate.errors import OptionError, UserError
from calibrate.measure import stats
from calibrate.profile import Group, Profile
from calibrate.records import Record

SEARCHES = ("auto", "pairs", "halving", "both")


@dataclass(frozen=True)
class HealthConfig:
    nbytes: int = 4 * 2 ** 20
    iters: int = 5
    warmup: int = 1
    slow: float = 1.5
    search: str = "auto"           # auto: every pair up to ``max_pair_nodes`` nodes, halving above
    max_pair_nodes: int = 16

    def check(self) -> None:
        if self.nbytes < 1:
            raise OptionError("nbytes", f"must be at least 1 byte, got {self.nbytes}")
        if self.iters < 1:
            raise OptionError("iters", f"must be at least 1, got {self.iters}")
        if self.warmup < 0:
            raise OptionError("warmup", f"must not be negative, got {self.warmup}")
        if not (math.isfinite(self.slow) and self.slow > 1):
            raise OptionError("slow", f"must be a factor above 1 (1.5: 50% slower than typical), got {self.slow}")
        if self.search not in SEARCHES:
            raise OptionError("search", f"{self.search!r} is not a search: choose from {', '.join(SEARCHES)}")
        if self.max_pair_nodes < 2:
            raise OptionError("max_pair_nodes", f"must be at least 2, got {self.max_pair_nodes}")

    def searches(self, nodes: int) -> tuple[bool, bool]:
        """(every pair, halving) for a cluster of ``nodes`` nodes."""
        if nodes < 2:
            return False, False
        if self.search == "auto":
            return nodes <= self.max_pair_nodes, nodes > self.max_pair_nodes
        return self.search in ("pairs", "both"), self.search in ("halving", "both")


@dataclass
class Timed:
    """One measured item (a rank, a node pair or a group of nodes) next to the profile."""

    name: str                  # "3" (a rank), "node1-node2" (a pair), "node0,node1" (a group)
    members: list[str]         # the hosts it involves (a rank: its host)
    measured_s: float
    expected_s: float
    slow: bool = False
    level: int = 0             # halving: 0 for all nodes, 1 for their halves, ...

    @property
    def fraction(self) -> float:
        return self.expected_s / self.measured_s if self.measured_s > 0 else float("inf")


@dataclass
class Suspect:
    kind: str   # node | pair | rank | group
    name: str
    why: str


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs covering every pair of ``n`` items once (the circle method)."""
    items = list(range(n)) + ([None] if n % 2 else [])
    m = len(items)
    rounds = []
    for _ in range(m - 1):
        pairs = [(items[i], items[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        items = [items[0], items[-1], *items[1:-1]]
    return rounds


def flag_outliers(items: list[Timed], slow: float) -> None:
    """Mark the items slower than ``slow`` times the typical (the median of their times with 3 or more,
    else each one's expected time) that are also slower than the profile expects: an item that delivers
    the profile's bandwidth is not suspect, however much faster its peers happen to be."""
    if not items:
        return
    typical = stats.median(t.measured_s for t in items) if len(items) >= 3 else None
    for t in items:
        t.slow = t.measured_s > slow * (typical if typical is not None else t.expected_s) \
            and t.measured_s > t.expected_s


def halving(nodes: list[int], measure: Callable[[list[list[int]]], list[float]],
            expected: Callable[[int], float], slow: float) -> list[Timed]:
    """The halving search over ``nodes``: ``measure(groups)`` times disjoint groups at once (one ring each)
    and returns their times; ``expected(k)`` is the profile's time for a ring of k nodes. The whole set is
    slow when it takes more than ``slow`` times its expected time; then the halves of every slow group are
    measured, all at once, and a half is slow when it takes more than ``slow`` times its sibling (or its
    expected time where the sibling is a single node, which no ring measures), down to pairs. Every
    measured group is returned, slow ones marked, with its level (0: all nodes). Each node of a slow pair
    is then ringed with a healthy node, and returned alone (one member) at the next level."""
    whole = measure([nodes])[0]
    out = [Timed(",".join(map(str, nodes)), [str(n) for n in nodes], whole, expected(len(nodes)),
                 whole > slow * expected(len(nodes)), 0)]
    frontier = [nodes] if out[0].slow else []
    level = 0
    while frontier:
        level += 1
        families = [[h for h in (g[: len(g) // 2], g[len(g) // 2:]) if len(h) >= 2] for g in frontier if len(g) > 2]
        halves = [h for f in families for h in f]
        if not halves:
            break
        times = iter(measure(halves))
        frontier = []
        for fam in families:
            ts = [next(times) for _ in fam]
            for k, (h, t) in enumerate(zip(fam, ts)):
                base = ts[1 - k] if len(fam) == 2 else expected(len(h))
                out.append(Timed(",".join(map(str, h)), [str(n) for n in h], t, expected(len(h)), t > slow * base, level))
                if out[-1].slow:
                    frontier.append(h)
    # a slow pair: each of its nodes in a ring with a healthy node (one of a group that was not slow)
    healthy = list(dict.fromkeys(int(m) for t in out if not t.slow for m in t.members))
    for pair in [t for t in out if t.slow and len(t.members) == 2]:
        a, b = (int(m) for m in pair.members)
        spare = [n for n in healthy if n not in (a, b)]
        if len(spare) < 2:
            continue
        ta, tb = measure([[a, spare[0]], [b, spare[1]]])
        for n, t, other in ((a, ta, tb), (b, tb, ta)):
            out.append(Timed(str(n), [str(n)], t, expected(2), t > slow * other, pair.level + 1))
    return out


def suspects(hosts: list[str], ranks: list[Timed], pairs: list[Timed], groups: list[Timed]) -> list[Suspect]:
    """Who to suspect: a node in every one of its pairs slow (3+ nodes), every other slow pair, slow
    ranks, and the smallest slow groups of the halving search."""
    out = []
    blamed = set()
    if len(hosts) >= 3 and pairs:
        for h in hosts:
            mine = [p for p in pairs if h in p.members]
            if mine and all(p.slow for p in mine):
                blamed.add(h)
                out.append(Suspect("node", h, f"every pair of {h} is slow "
                                             f"({', '.join(f'{p.name} {p.fraction:.0%}' for p in mine)} of the profile)"))
    for p in pairs:
        if p.slow and not set(p.members) & blamed:
            out.append(Suspect("pair", p.name, f"{p.measured_s * 1e3:.3g} ms, {p.fraction:.0%} of the profile's "
                                               f"bandwidth, more than the typical pair's time times the threshold"))
    for r in ranks:
        if r.slow:
            out.append(Suspect("rank", r.name, f"rank {r.name} on {r.members[0]}: {r.measured_s * 1e3:.3g} ms, "
                                               f"{r.fraction:.0%} of the profile's intra-node bandwidth"))
    slow_groups = [g for g in groups if g.slow]
    for g in slow_groups:
        inner = [s for s in slow_groups if s.level > g.level and set(s.members) < set(g.members)]
        if not inner:
            out.append(Suspect("node" if len(g.members) == 1 else "group", g.name,
                               f"the smallest slow group of the halving search: {g.fraction:.0%} of the profile"))
    return out


# ---- measuring (MPI) ---------------------------------------------------------------------


def _rings(world, rings: list[list[int]], nbytes: int, iters: int, warmup: int) -> float | None:
    """Every ring of world ranks at once: each member sends ``nbytes`` to the next and receives from
    the previous (a pair exchanges both ways); this rank's median time, None when it is in no ring."""
    rank = world.Get_rank()
    mine = next((r for r in rings if rank in r), None)
    buf = np.ones(max(nbytes, 1), dtype=np.uint8)
    out = np.empty_like(buf)
    times = []
    for i in range(warmup + iters):
        world.Barrier()
        if mine is None:
            continue
        k = mine.index(rank)
        start = time.perf_counter()
        world.Sendrecv(buf, dest=mine[(k + 1) % len(mine)], recvbuf=out, source=mine[(k - 1) % len(mine)])
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return stats.median(times) if mine is not None else None


def _node_rings(world, node_ranks: list[list[int]], groups: list[list[int]], cfg: HealthConfig) -> list[float]:
    """Each group of nodes timed as rings of its nodes' k-th ranks, every group at once; the slowest
    rank's time per group."""
    rings = [[node_ranks[n][k] for n in g] for g in groups for k in range(len(node_ranks[g[0]]))]
    t = world.allgather(_rings(world, rings, cfg.nbytes, cfg.iters, cfg.warmup))
    return [max(t[node_ranks[n][k]] for n in g for k in range(len(node_ranks[n]))) for g in groups]


def measure(world, profile: Profile, cfg: HealthConfig) -> "HealthRecord | None":
    """The health check on every rank of ``world``; the record on rank 0, None elsewhere."""
    import socket

    cfg.check()
    hosts_of = world.allgather(socket.gethostname())
    hosts = list(dict.fromkeys(hosts_of))
    node_ranks = [[r for r, h in enumerate(hosts_of) if h == host] for host in hosts]
    per_node = {len(r) for r in node_ranks}
    if len(per_node) != 1:
        raise UserError(f"the nodes have different numbers of ranks {sorted(per_node)}: start the same number of "
                        f"ranks on every node")
    ppn = per_node.pop()
    sendrecv = Collective.SENDRECV
    do_pairs, do_halving = cfg.searches(len(hosts))
    if len(hosts) >= 2:
        profile.model(sendrecv, Group(2, 2))  # a profile without an inter tier fails here, before any work
    if ppn >= 2:
        profile.model(sendrecv, Group(ppn, 1))

    ranks: list[Timed] = []
    if ppn >= 2:
        t = world.allgather(_rings(world, node_ranks, cfg.nbytes, cfg.iters, cfg.warmup))
        exp = profile.time(sendrecv, cfg.nbytes, Group(ppn, 1))
        ranks = [Timed(str(r), [hosts_of[r]], t[r], exp) for r in range(world.Get_size())]
        flag_outliers(ranks, cfg.slow)

    pairs: list[Timed] = []
    if do_pairs:
        exp = profile.time(sendrecv, cfg.nbytes, Group(2, 2))
        for rnd in round_robin(len(hosts)):
            times = _node_rings(world, node_ranks, [list(p) for p in rnd], cfg)
            pairs += [Timed(f"{hosts[a]}-{hosts[b]}", [hosts[a], hosts[b]], t, exp) for (a, b), t in zip(rnd, times)]
        flag_outliers(pairs, cfg.slow)

    groups: list[Timed] = []
    if do_halving:
        found = halving(list(range(len(hosts))), lambda gs: _node_rings(world, node_ranks, gs, cfg),
                        lambda k: profile.time(sendrecv, cfg.nbytes, Group(k, k)), cfg.slow)
        groups = [Timed(",".join(hosts[int(m)] for m in g.members), [hosts[int(m)] for m in g.members],
                        g.measured_s, g.expected_s, g.slow, g.level) for g in found]
    if world.Get_rank() != 0:
        return None
    return HealthRecord(created=_dt.datetime.now().isoformat(timespec="seconds"), profile=profile.name,
                        config=asdict(cfg), hosts=hosts, ranks_per_node=ppn, ranks=ranks, pairs=pairs, groups=groups,
                        suspects=suspects(hosts, ranks, pairs, groups))


# ---- the record ----------------------------------------------------------------------------


@dataclass
class HealthRecord(Record):
    KIND = "commtune.health"
    VERSION = 1
    WHAT = "health record"
    FIX = "measure it again with python -m calibrate health"

    created: str
    profile: str
    config: dict
    hosts: list[str]
    ranks_per_node: int
    ranks: list[Timed] = field(default_factory=list)
    pairs: list[Timed] = field(default_factory=list)
    groups: list[Timed] = field(default_factory=list)
    suspects: list[Suspect] = field(default_factory=list)

    def body(self) -> dict:
        item = lambda t: {**asdict(t), "fraction": t.fraction}  # noqa: E731
        return {"created": self.created, "profile": self.profile, "config": self.config, "hosts": self.hosts,
                "ranks_per_node": self.ranks_per_node, "ranks": [item(t) for t in self.ranks],
                "pairs": [item(t) for t in self.pairs], "groups": [item(t) for t in self.groups],
                "suspects": [asdict(s) for s in self.suspects]}

    @classmethod
    def from_body(cls, d: dict, origin: str) -> "HealthRecord":
        def bad(what: str):
            return UserError(f"{origin}: {what}: {cls.FIX}")

        for key, typ in (("created", str), ("profile", str), ("config", dict), ("hosts", list),
                         ("ranks_per_node", int), ("ranks", list), ("pairs", list), ("groups", list),
                         ("suspects", list)):
            if not isinstance(d.get(key), typ) or isinstance(d.get(key), bool):
                raise bad(f"{key!r} is missing or not a {typ.__name__}")
        if not d["hosts"] or not all(isinstance(h, str) for h in d["hosts"]):
            raise bad("'hosts' is not a non-empty list of host names")
        if d["ranks_per_node"] < 1:
            raise bad(f"'ranks_per_node' {d['ranks_per_node']} is below 1")

        def timed(t, where: str) -> Timed:
            if not isinstance(t, dict):
                raise bad(f"an entry of {where!r} is not an object")
            for key in ("measured_s", "expected_s"):
                v = t.get(key)
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                    raise bad(f"{where}: {key} {v!r} is not a finite time >= 0")
            if not isinstance(t.get("name"), str) or not isinstance(t.get("members"), list) \
                    or not all(isinstance(m, str) for m in t["members"]):
                raise bad(f"{where}: an entry without a name or members")
            if not isinstance(t.get("slow"), bool) or not isinstance(t.get("level", 0), int):
                raise bad(f"{where}: {t.get('name')}: 'slow' is not true/false or 'level' not an integer")
            return Timed(t["name"], t["members"], float(t["measured_s"]), float(t["expected_s"]), t["slow"],
                         int(t.get("level", 0)))

        pairs = [timed(t, "pairs") for t in d["pairs"]]
        for p in pairs:
            if len(p.members) != 2 or not set(p.members) <= set(d["hosts"]):
                raise bad(f"pair {p.name!r} does not join two of the hosts {d['hosts']}")
        sus = []
        for s in d["suspects"]:
            if not isinstance(s, dict) or s.get("kind") not in ("node", "pair", "rank", "group") \
                    or not isinstance(s.get("name"), str) or not isinstance(s.get("why"), str):
                raise bad(f"a suspect {s!r} is not {{kind: node|pair|rank|group, name, why}}")
            sus.append(Suspect(s["kind"], s["name"], s["why"]))
        return cls(d["created"], d["profile"], d["config"], d["hosts"], d["ranks_per_node"],
                   [timed(t, "ranks") for t in d["ranks"]], pairs,
                   [timed(t, "groups") for t in d["groups"]], sus)

    def matrix(self) -> np.ndarray:
        """Node x node: each pair's fraction of the profile's bandwidth (NaN on the diagonal and unmeasured)."""
        index = {h: i for i, h in enumerate(self.hosts)}
        m = np.full((len(self.hosts), len(self.hosts)), np.nan)
        for p in self.pairs:
            a, b = (index[h] for h in p.members)
            m[a, b] = m[b, a] = p.fraction
        return m
