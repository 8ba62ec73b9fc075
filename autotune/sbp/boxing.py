"""Boxing: the collectives that turn one nd-SBP of a tensor into another.

Per fine mesh axis the transition is one of (AutoDDL §4.3, OneFlow boxing):
P->S(i) reduce-scatter, P->B all-reduce, S(i)->S(j) all-to-all, S(i)->B
all-gather, B->S(i) a local slice, B->P a local zeroing (keep the value on
coordinate 0), S(i)->P an all-gather then zeroing. Axes making the same
transition run as one collective over the group they span. The phases run in
the order that keeps messages small: free slices first, then reduce-scatters
(intra-node part first, so the inter-node part moves 1/g of the bytes), then
all-reduces, all-to-alls, and all-gathers last (inter-node part first). Where
an intermediate would not divide evenly, slices move last, then all-gathers
first; if no order divides, the transition is impossible (cost inf in a search). This
yields the multi-step paths of §4.3, e.g. (S0, S1, P) -> (S0, S1: p1*p2) ->
(S0, B, S1) is a reduce-scatter over p2 then an all-gather over p1.

The backward pass moves the gradient from dual(dst) to dual(src) (B and P
swap, S stays): forward reduce-scatter/all-gather become all-gather/
reduce-scatter; a forward all-reduce (P->B) is an all-reduce backward too
(the gradient of a B input comes back partial, P->B), unless the consumer
returns its input's gradient whole (``Strategy.grad_in``: a loss computed
redundantly), where it is free; a forward zeroing (B->P) is free backward.

A step runs at once on every group of its axes; where groups cross nodes,
the groups on one node share its network, so the bandwidth term of such a step
is multiplied by how many share it (``Coster.nic_sharing``), relative to how
many shared it when the profile measured that group size (``groups_per_node``
of the profile's model: a calibrated inter tier measured the one-rank-per-node
groups all at once, one per rank of a node), or, where the profile's tier
is per GPU (``Profile.per``: one NIC each), relative to the node's GPUs.

Message sizes follow nccl-tests' ``size`` (calibrate.collectives): all-reduce
the vector, reduce-scatter its input, all-gather its output, all-to-all one
rank's whole send buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.collectives import Collective, ring_coefficients
from calibrate.errors import OptionError, UserError
from calibrate.profile import Group, Profile

from autotune.sbp.mesh import Cluster
from autotune.sbp.sbp import B, P, dual, is_split, local_shape, split_dim

LOCAL_OPS = ("slice", "zero")


@dataclass(frozen=True)
class Step:
    """One boxing step over the fine ``axes``; ``op`` a Collective value or a local op."""

    op: str
    axes: tuple[int, ...]
    nbytes: int
    src_dim: int = -1
    dst_dim: int = -1

    @property
    def collective(self) -> Collective | None:
        return None if self.op in LOCAL_OPS else Collective(self.op)


def _local_elems_or_none(shape, cur, cluster) -> int | None:
    """Elements of one device's piece under fine placements ``cur``; None if a split does not divide."""
    div = [1] * len(shape)
    for p, size in zip(cur, cluster.axis_sizes):
        if p[0] == "S":
            d = int(p[1:])
            if d >= len(shape):
                return None
            div[d] *= size
    n = 1
    for s, k in zip(shape, div):
        if s % k:
            return None
        n *= s // k
    return n


def _local_elems(shape, cur, cluster) -> int:
    n = _local_elems_or_none(shape, cur, cluster)
    if n is None:
        local_shape(shape, tuple(cur), cluster)  # raises the UserError naming the split
    return n


def _by_tier(axes, cluster, inter_first: bool):
    intra = tuple(a for a in axes if not cluster.axis_inter[a])
    inter = tuple(a for a in axes if cluster.axis_inter[a])
    parts = (inter, intra) if inter_first else (intra, inter)
    return [p for p in parts if p]


def _path(shape, itemsize, src, dst, cluster, early_slices: bool, gather_first: bool) -> tuple[Step, ...]:
    cur = list(src)
    steps: list[Step] = []
    n = len(cur)

    def set_axes(axes, value_of):
        for a in axes:
            cur[a] = value_of(a)
        if _local_elems_or_none(shape, cur, cluster) is None:
            raise ValueError("intermediate does not divide")

    def slices():
        axes = tuple(a for a in range(n) if cur[a] == B and is_split(dst[a]))
        for d in sorted({split_dim(dst[a]) for a in axes}):
            grp = tuple(a for a in axes if split_dim(dst[a]) == d)
            set_axes(grp, lambda a: dst[a])
            steps.append(Step("slice", grp, _local_elems(shape, cur, cluster) * itemsize, -1, d))

    def gathers():
        # S(i) -> B or P: all-gather, inter-node part first
        ag = {a: split_dim(cur[a]) for a in range(n) if is_split(cur[a]) and dst[a] in (B, P)}
        for d in sorted(set(ag.values())):
            for grp in _by_tier([a for a in ag if ag[a] == d], cluster, inter_first=True):
                set_axes(grp, lambda a: B)
                steps.append(Step(Collective.ALLGATHER.value, grp, _local_elems(shape, cur, cluster) * itemsize, d, -1))

    if early_slices:
        slices()
    if gather_first:
        gathers()
    # P -> S(i): reduce-scatter, intra-node part first
    rs = [a for a in range(n) if cur[a] == P and is_split(dst[a])]
    for d in sorted({split_dim(dst[a]) for a in rs}):
        for grp in _by_tier([a for a in rs if split_dim(dst[a]) == d], cluster, inter_first=False):
            nb = _local_elems(shape, cur, cluster) * itemsize
            set_axes(grp, lambda a: dst[a])
            steps.append(Step(Collective.REDUCESCATTER.value, grp, nb, -1, d))
    # P -> B: all-reduce
    ar = tuple(a for a in range(n) if cur[a] == P and dst[a] == B)
    if ar:
        steps.append(Step(Collective.ALLREDUCE.value, ar, _local_elems(shape, cur, cluster) * itemsize))
        set_axes(ar, lambda a: B)
    # S(i) -> S(j): all-to-all
    a2a = {a: (split_dim(cur[a]), split_dim(dst[a])) for a in range(n)
           if is_split(cur[a]) and is_split(dst[a]) and cur[a] != dst[a]}
    for i, j in sorted(set(a2a.values())):
        grp = tuple(a for a in a2a if a2a[a] == (i, j))
        nb = _local_elems(shape, cur, cluster) * itemsize
        set_axes(grp, lambda a: dst[a])
        steps.append(Step(Collective.ALLTOALL.value, grp, nb, i, j))
    if not gather_first:
        gathers()
    if not early_slices:
        slices()
    zero = tuple(a for a in range(n) if cur[a] == B and dst[a] == P)
    if zero:
        set_axes(zero, lambda a: P)
        steps.append(Step("zero", zero, 0))
    return tuple(steps)


def copies_around(op: str, src_dim: int = -1, dst_dim: int = -1) -> int:
    """How many local copies of a step's message (each reading and writing it) PyTorch's DTensor makes
    around a step ``op`` that gathers dimension ``src_dim`` and splits ``dst_dim``, as ``autotune execute``
    runs it: the functional all-reduce clones its input; an all-gather along a dimension other than 0
    concatenates the gathered chunks, a reduce-scatter along one chunks its input into a contiguous buffer,
    an all-to-all does both on the dimensions that are not 0; a slice copies its piece out (its own
    storage). A zeroing (B -> P) writes zeros on the devices off coordinate 0 only and is not counted."""
    if op == Collective.ALLREDUCE.value or op == "slice":
        return 1
    if op == Collective.ALLGATHER.value:
        return int(src_dim != 0)
    if op == Collective.REDUCESCATTER.value:
        return int(dst_dim != 0)
    if op == Collective.ALLTOALL.value:
        return int(src_dim != 0) + int(dst_dim != 0)
    return 0


def local_copies(step: Step) -> int:
    """``copies_around`` a boxing step."""
    return copies_around(step.op, step.src_dim, step.dst_dim)


def copy_seconds(steps, memory_seconds) -> float:
    """Seconds of the local copies around ``steps`` (``local_copies``), each timed by ``memory_seconds``
    on the bytes it reads and writes."""
    return sum(n * memory_seconds(2 * st.nbytes) for st in steps for n in (local_copies(st),) if n)


def box(shape: tuple[int, ...], itemsize: int, src: tuple[str, ...], dst: tuple[str, ...],
        cluster: Cluster) -> tuple[Step, ...]:
    """The steps that redistribute a tensor of ``shape`` from fine placements ``src`` to ``dst``."""
    if len(src) != len(cluster.axis_sizes) or len(dst) != len(cluster.axis_sizes):
        raise UserError(f"boxing needs one placement per fine mesh axis ({len(cluster.axis_sizes)}) on {cluster}")
    local_shape(shape, src, cluster)
    local_shape(shape, dst, cluster)
    if src == dst:
        return ()
    for early, gather_first in ((True, False), (False, False), (False, True)):
        try:
            return _path(shape, itemsize, src, dst, cluster, early, gather_first)
        except ValueError:
            continue
    raise UserError(
        f"no boxing path from {src} to {dst} for shape {shape} keeps every intermediate evenly divisible: "
        f"pick sizes divisible by the device count"
    )


def box_backward(shape, itemsize, src, dst, cluster) -> tuple[Step, ...]:
    """Steps of the gradient's redistribution in the backward pass."""
    return box(shape, itemsize, tuple(dual(p) for p in dst), tuple(dual(p) for p in src), cluster)


class Coster:
    """Times steps with a profile on a cluster, memoising per (collective, bytes, group)."""

    def __init__(self, profile: Profile, cluster: Cluster):
        self.profile = profile
        self.cluster = cluster
        self._memo: dict = {}
        self._check_tiers()

    def _check_tiers(self):
        need = []
        if self.cluster.gpus_per_node > 1:
            need.append("intra")
        if self.cluster.nodes > 1:
            need.append("inter")
        for tier in need:
            if not self.profile.tiers.get(tier):
                raise OptionError(
                    "profile", f"{self.profile.name!r} has no {tier} tier but the cluster {self.cluster} needs one: "
                               f"give a profile measured {'inside a node' if tier == 'intra' else 'across nodes'}")

    def nic_sharing(self, ranks: int, nodes: int) -> int:
        """How many groups of a collective share each node's network: a step runs at once on every group
        of its axes, and a group spanning ``nodes`` nodes with ``ranks / nodes`` ranks on each leaves the
        node's other GPUs to as many other groups, all crossing the same network. 1 inside a node."""
        return 1 if nodes == 1 else max(1, self.cluster.gpus_per_node * nodes // ranks)

    def group_time(self, coll: Collective, nbytes: int, ranks: int, nodes: int) -> float:
        """A collective on one group, costed on the profile, with its bandwidth term shared with the
        groups that cross the same node's network at the same time: e.g. the inter-node step of a
        hierarchical all-gather over 2 nodes x 16 GPUs runs as 16 concurrent pairs, each at 1/16 of the
        node's bandwidth where the profile's figure is one group a node, and at the figure itself where
        the profile measured 16 pairs at once (``Profile.time``'s ``groups_per_node``) or states its inter
        bandwidth per GPU (``Profile.per``)."""
        return self.profile.time(coll, nbytes, Group(ranks, nodes), groups_per_node=self.nic_sharing(ranks, nodes),
                                 gpus_per_node=self.cluster.gpus_per_node)

    def step_time(self, step: Step) -> float:
        if step.op in LOCAL_OPS:
            return 0.0
        key = (step.op, step.nbytes, step.axes)
        t = self._memo.get(key)
        if t is None:
            g = self.cluster.group(step.axes)
            t = self.group_time(Collective(step.op), step.nbytes, g.ranks, g.nodes)
            self._memo[key] = t
        return t

    def time(self, steps) -> float:
        return sum(self.step_time(s) for s in steps)

    def volume(self, step: Step, itemsize: int) -> float:
        """Elements one rank sends in the ring algorithm (b(p) * n, Table 2)."""
        if step.op in LOCAL_OPS:
            return 0.0
        p = self.cluster.group(step.axes).ranks
        return ring_coefficients(Collective(step.op), p)[1] * step.nbytes / itemsize
