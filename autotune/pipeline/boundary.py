"""A stage boundary priced as it executes, and as the resharding planner would move it.

Forward, the last layer's output of stage i (placement ``out`` on stage i's submesh) becomes the first
layer's input of stage i + 1 (placement ``in`` on its submesh); backward, that input's gradient
(``grad``) returns as the output's gradient (dual(out): B and P swap, S stays, the stages' own boxing
rule, ``autotune.sbp.boxing``). A placement is on the fine axes of the stage's own cluster
(``autotune.sbp.mesh``); each device's tile follows from it exactly (the splits of a dimension in
fine-axis order, the first axis major; a P axis holds the whole extent).

As it executes (``route``; ``autotune.apply.pipeline``, torch.distributed.pipelining), by one of two routes
(``ROUTES``), the cheaper one (forward plus backward) per boundary, named in the plan record
(``boundary_route``, with the placement the tiles cross in, ``boundary_sent``):

- ``direct``: each rank sends its own local tile in ``out`` (a P axis whole) to the rank of stage i + 1 at
  the same mesh coordinates (one unit task per device pair, all at once, priced by the resharding planner's
  network: pairs crossing nodes share the node's port), and the receiving submesh redistributes it from
  ``out`` to ``in`` (DTensor; priced as the boxing ``out -> in`` on that submesh with the profile's tiers,
  ``Coster``): an S0 -> B boundary pays an all-gather on the receiving submesh, a partial output its whole
  tiles sent and a reduction there. Backward: the gradient is redistributed on stage i + 1's submesh from
  ``grad`` to dual(out), then each rank's tile goes back to its pair.
- ``scatter`` (an output with P axes; Megatron's scatter-gather of pipeline tensors): the sending submesh
  first reduce-scatters the partial sum (``sent``: each P axis of ``out`` made S along the dimension the
  receiving placement splits on that axis, else the features, the last dimension; ``sent_placement``), the
  smaller tiles cross pairwise, and the receiving submesh redistributes ``sent -> in`` (e.g. the
  all-gather where ``in`` is B). Backward the mirror image: ``grad -> dual(sent)`` on the receiving
  submesh, the tiles sent back, and on the sender ``dual(sent) -> dual(out)`` (the gradient of the
  reduce-scatter, an all-gather).

Equal placements cost the tile transfer alone. The two submeshes must have the same shape (the search's
stages do).

As the resharding planner moves it (``planned``: the resharding paper's unit tasks, send/recv or
broadcast strategies and load-balancing solvers; optimistic by the receiving submesh's collective where
placements differ, kept as a second figure): the unit tasks are the intersections of the distinct source and
destination tiles, as ``kernels.reshard.tasks.unit_tasks`` makes them for a sharding spec. A partial (P)
tensor is reduced on its own submesh before it leaves (the boxing P -> B priced by the stage's ``Coster``);
a partial destination (the gradient of a replicated output) takes disjoint tiles, its P axes splitting the
dimension the source splits most (zeros elsewhere are a valid partial), so one replica receives each
piece and the pieces line up with the source's. A unit task held by many replicas offers at most ``SENDERS`` of them as senders, a different run of them for each
unit (the solver's load balancing still spreads the sends; without the cap a replicated source of 256
devices costs the solver minutes).

Devices: stage i's submesh is the i-th run of whole nodes, or the i-th slice of a node, in rank order, so
transfers between whole-node stages use the profile's inter-node tier and those inside one node its
intra-node tier (``autotune.reshard.network``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from calibrate.errors import UserError

from autotune.plan.typed import DIRECT, SCATTER
from autotune.reshard.plan import make_plan
from autotune.reshard.solvers import SolverConfig
from autotune.sbp.boxing import Coster, box
from autotune.sbp.mesh import Cluster
from autotune.sbp.sbp import B, P, dual, is_split, local_shape, split_dim
from kernels.reshard.spec import Box, Mesh, ShardingSpec, box_volume
from kernels.reshard.tasks import ReshardTask, UnitTask

STRATEGY, SOLVER = "broadcast", "ensemble"
SOLVER_CONFIG = SolverConfig(time_budget=0.05, rounds=4, restarts=1)
SENDERS = 8


@dataclass(frozen=True)
class Route:
    """How one boundary runs: ``name`` (``ROUTES``), the placement its tiles cross in (``sent``, on the
    sending submesh's fine axes) and its seconds per micro-batch each way."""

    name: str
    sent: tuple[str, ...]
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


def sent_placement(shape, out_fine: tuple[str, ...], in_fine: tuple[str, ...],
                   cluster: Cluster) -> tuple[str, ...] | None:
    """The scatter route's placement: each P axis of ``out_fine`` split along the dimension ``in_fine`` splits on
    that axis, else the last (the features); None where ``out_fine`` has no P or a split does not divide."""
    if P not in out_fine:
        return None
    last = f"S{len(shape) - 1}"
    sent = tuple((q if is_split(q) and split_dim(q) < len(shape) else last) if o == P else o
                 for o, q in zip(out_fine, in_fine))
    try:
        local_shape(shape, sent, cluster)
    except UserError:
        return None
    return sent


def submesh_devices(stage: int, sub: Cluster, gpus_per_node: int) -> tuple[int, ...]:
    """Global device ids of stage ``stage``'s submesh, in its rank order."""
    if sub.gpus_per_node == gpus_per_node:
        first = stage * sub.nodes * gpus_per_node
        return tuple(range(first, first + sub.devices))
    first = stage * sub.gpus_per_node
    return tuple(range(first, first + sub.gpus_per_node))


def tiles(shape: tuple[int, ...], fine: tuple[str, ...], cluster: Cluster, devices) -> dict[int, Box]:
    """Each device's box of the tensor under fine-axis placement ``fine`` (P read as B)."""
    out = {}
    for rank, dev in enumerate(devices):
        coords = cluster.coords(rank)
        box = []
        for d, n in enumerate(shape):
            idx, parts = 0, 1
            for a, p in enumerate(fine):
                if p == f"S{d}":
                    idx, parts = idx * cluster.axis_sizes[a] + coords[a], parts * cluster.axis_sizes[a]
            size = n // parts
            box.append((idx * size, (idx + 1) * size))
        out[dev] = tuple(box)
    return out


def _groups(t: dict[int, Box]) -> list[tuple[Box, tuple[int, ...]]]:
    g: dict[Box, list[int]] = {}
    for dev, b in t.items():
        g.setdefault(b, []).append(dev)
    return [(b, tuple(d)) for b, d in g.items()]


def units(shape, itemsize: int, src: dict[int, Box], dst: dict[int, Box]) -> list[UnitTask]:
    """The unit tasks: each distinct destination tile's intersections with the distinct source tiles, in that
    order (the overlaps of one destination tile with every source tile found at once, as integer arrays)."""
    out = []
    sg = _groups(src)
    lo = np.array([[a for a, _ in b] for b, _ in sg], dtype=np.int64).reshape(len(sg), len(shape))
    hi = np.array([[z for _, z in b] for b, _ in sg], dtype=np.int64).reshape(len(sg), len(shape))
    for dbox, receivers in _groups(dst):
        dlo = np.array([a for a, _ in dbox], dtype=np.int64)
        dhi = np.array([z for _, z in dbox], dtype=np.int64)
        plo, phi = np.maximum(lo, dlo), np.minimum(hi, dhi)
        for i in np.flatnonzero((plo < phi).all(axis=1)):
            senders = sg[i][1]
            piece = tuple((int(a), int(z)) for a, z in zip(plo[i], phi[i]))
            k = len(out)
            if len(senders) > SENDERS:
                step = len(senders) // SENDERS
                senders = tuple(senders[(k + j * step) % len(senders)] for j in range(SENDERS))
            out.append(UnitTask(k, piece, senders, receivers, box_volume(piece) * itemsize))
    return out


def _whole(fine: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(B if p == P else p for p in fine)


def _receive(fine: tuple[str, ...], shape, cluster: Cluster, src: Cluster, src_fine) -> tuple[str, ...]:
    """A destination placement as received: its P axes take disjoint pieces along the dimension the source
    splits most (so pieces line up with the source's tiles), B where that does not divide."""
    if P not in fine:
        return fine
    split = [math.prod(src.axis_sizes[a] for a, p in enumerate(src_fine) if p == f"S{d}") for d in range(len(shape))]
    d = max(range(len(shape)), key=lambda i: split[i])
    parts = math.prod(cluster.axis_sizes[a] for a, p in enumerate(fine) if p in (P, f"S{d}"))
    sd = f"S{d}" if shape[d] % parts == 0 else B
    return tuple(sd if p == P else p for p in fine)


class BoundaryPricer:
    """Seconds per micro-batch of one boundary, cached by (placements, submeshes, devices' layout)."""

    def __init__(self, profile, gpus_per_node: int, itemsize: int):
        self.profile, self.gpus_per_node, self.itemsize = profile, gpus_per_node, itemsize
        self._cache: dict = {}
        self._coster: dict = {}

    def _costs(self, cluster: Cluster) -> Coster:
        return self._coster.setdefault(cluster, Coster(self.profile, cluster))

    def redistribute(self, shape, src_fine, dst_fine, cluster: Cluster) -> float:
        """Seconds of the boxing ``src_fine -> dst_fine`` on ``cluster`` (inf where no path divides evenly)."""
        try:
            steps = box(tuple(shape), self.itemsize, src_fine, dst_fine, cluster)
        except UserError:
            return math.inf
        return self._costs(cluster).time(steps)

    def _reduce(self, shape, fine, cluster: Cluster) -> float:
        return self.redistribute(shape, fine, _whole(fine), cluster) if P in fine else 0.0

    def _makespan(self, shape, src: Cluster, src_devs, dst: Cluster, dst_devs, us: list[UnitTask]) -> float:
        task = ReshardTask(tuple(shape), "float16" if self.itemsize == 2 else "float32",
                           _mesh(src, src_devs, self.gpus_per_node), ShardingSpec.parse("R" * len(shape)),
                           _mesh(dst, dst_devs, self.gpus_per_node), ShardingSpec.parse("R" * len(shape)))
        return make_plan(task, self.profile, STRATEGY, SOLVER, SOLVER_CONFIG, us, bound=0.0).makespan

    def _layout(self, src_devs, dst_devs) -> tuple:
        return tuple(d // self.gpus_per_node - src_devs[0] // self.gpus_per_node for d in src_devs + dst_devs)

    def transfer(self, shape, fine, src: Cluster, src_devs, dst_devs) -> float:
        """Seconds to send every rank's local tile under ``fine`` (P read whole) to the rank at the same
        coordinates of the next submesh (of ``src``'s shape), all pairs at once."""
        key = ("transfer", tuple(shape), fine, src, self._layout(src_devs, dst_devs))
        hit = self._cache.get(key)
        if hit is None:
            t = tiles(shape, _whole(fine), src, src_devs)
            us = [UnitTask(k, t[a], (a,), (b,), box_volume(t[a]) * self.itemsize)
                  for k, (a, b) in enumerate(zip(src_devs, dst_devs))]
            hit = self._cache[key] = self._makespan(shape, src, src_devs, src, dst_devs, us)
        return hit

    def move(self, shape, src_fine, src: Cluster, src_devs, dst_fine, dst: Cluster, dst_devs) -> float:
        """Seconds to move a tensor from (src_fine on src_devs) to (dst_fine on dst_devs) by the resharding
        planner's unit tasks."""
        key = ("move", tuple(shape), src_fine, src, dst_fine, dst, self._layout(src_devs, dst_devs))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        a = tiles(shape, _whole(src_fine), src, src_devs)
        b = tiles(shape, _receive(dst_fine, shape, dst, src, src_fine), dst, dst_devs)
        us = units(shape, self.itemsize, a, b)
        t = self._reduce(shape, src_fine, src) + self._makespan(shape, src, src_devs, dst, dst_devs, us)
        self._cache[key] = t
        return t

    def routes(self, shape, out_fine, in_fine, grad_fine, src: Cluster, dst: Cluster, stage: int) -> list[Route]:
        """The routes the executor can run for the boundary between stage ``stage`` and the next (module doc):
        the direct one, and the scatter one where the output is partial and its split divides."""
        if src != dst:
            raise UserError(f"a boundary as it executes pairs ranks at the same coordinates: submeshes {src} and "
                            f"{dst} differ; give every stage the same submesh")
        layout = self._layout(submesh_devices(stage, src, self.gpus_per_node),
                              submesh_devices(stage + 1, dst, self.gpus_per_node))
        key = ("routes", tuple(shape), out_fine, in_fine, grad_fine, src, layout)
        hit = self._cache.get(key)
        if hit is None:
            hit = [self._route(DIRECT, out_fine, shape, out_fine, in_fine, grad_fine, src, stage)]
            sent = sent_placement(shape, out_fine, in_fine, src)
            if sent is not None:
                hit.append(self._route(SCATTER, sent, shape, out_fine, in_fine, grad_fine, src, stage))
            self._cache[key] = hit
        return list(hit)

    def route(self, shape, out_fine, in_fine, grad_fine, src: Cluster, dst: Cluster, stage: int) -> Route:
        """The route the boundary runs: the cheapest of ``routes``, forward and backward together."""
        return min(self.routes(shape, out_fine, in_fine, grad_fine, src, dst, stage), key=lambda r: r.total)

    def _route(self, name, sent, shape, out_fine, in_fine, grad_fine, sub: Cluster, stage: int) -> Route:
        """``out`` -> ``sent`` on the sending submesh, the tiles in ``sent`` to their pairs, ``sent`` -> ``in`` on the
        receiving one; backward ``grad`` -> dual(sent) there, the tiles back, dual(sent) -> dual(out)."""
        sd = submesh_devices(stage, sub, self.gpus_per_node)
        dd = submesh_devices(stage + 1, sub, self.gpus_per_node)
        back = tuple(dual(p) for p in sent)
        fwd = (self.redistribute(shape, out_fine, sent, sub) + self.transfer(shape, sent, sub, sd, dd)
               + self.redistribute(shape, sent, in_fine, sub))
        bwd = (self.redistribute(shape, grad_fine, back, sub) + self.transfer(shape, back, sub, dd, sd)
               + self.redistribute(shape, back, tuple(dual(p) for p in out_fine), sub))
        return Route(name, tuple(sent), fwd, bwd)

    def boundary(self, shape, out_fine, in_fine, grad_fine, src: Cluster, dst: Cluster,
                 stage: int) -> tuple[float, float]:
        """(forward, backward) seconds per micro-batch between stage ``stage`` and the next, as it executes
        (``route``)."""
        r = self.route(shape, out_fine, in_fine, grad_fine, src, dst, stage)
        return r.forward, r.backward

    def planned(self, shape, out_fine, in_fine, grad_fine, src: Cluster, dst: Cluster, stage: int) -> tuple[float, float]:
        """(forward, backward) seconds per micro-batch between stage ``stage`` and the next as the resharding
        planner moves it: the output ``out_fine`` into the input ``in_fine`` by direct tile-to-tile transfers;
        the input's gradient ``grad_fine`` back into the output's."""
        sd = submesh_devices(stage, src, self.gpus_per_node)
        dd = submesh_devices(stage + 1, dst, self.gpus_per_node)
        fwd = self.move(shape, out_fine, src, sd, in_fine, dst, dd)
        bwd = self.move(shape, grad_fine, dst, dd, tuple(dual(p) for p in out_fine), src, sd)
        return fwd, bwd


def _mesh(cluster: Cluster, devices, gpus_per_node: int) -> Mesh:
    hosts = len({d // gpus_per_node for d in devices})
    return Mesh((hosts, len(devices) // hosts), tuple(devices), gpus_per_node)
