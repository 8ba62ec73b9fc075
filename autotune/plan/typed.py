"""The typed plan: one dataclass tree for everything a plan tells a user, as a
versioned record (kind ``commtune.plan``) with one validating loader.

``TypedPlan`` holds the model (kind and config fields), the cluster, the fine
mesh (one DeviceMesh dimension per fine axis of the cluster, node axes first:
``autotune.sbp.mesh``), per distinct layer its placements per fine axis
("S0", "S1", ... split, "B" replicated, "P" partial sum) of input, output and
each weight with the weight's shape, recomputation, FSDP sharding,
micro-batches, predicted costs and memory (with its breakdown) and the
baselines' costs.

    plan = load_plan("plan.json")         # a typed plan, or plan.json of python -m autotune (converted)
    plan = convert(best, baselines)       # from today's plan dict (autotune.plan.search)
    plan.save("typed.json")

Placements are the SBP strings of ``autotune.sbp.sbp``; ``dtensor_placements``
spells them as PyTorch's ``Shard``/``Replicate``/``Partial`` (without importing torch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.records import check_header, header

from autotune.sbp.mesh import Cluster
from autotune.sbp.sbp import B, P, is_split, split_dim

# the routes of a pipelined plan's stage boundary (``autotune.pipeline.boundary`` prices them): the stream sent as
# the last stage layer holds it, or scattered first
DIRECT, SCATTER = "direct", "scatter"
ROUTES = (DIRECT, SCATTER)



class ApplyPath(StrEnum):
    """How ``apply`` places a plan, decided once from the plan (``autotune.plan.layouts.plan_path``): its
    value is the name records and profiles' host figures use, and it compares equal to it. The deciders
    return the value, a plain str: results that hold it load with ``torch.load``'s ``weights_only``."""

    NONE = "none"  # one device: the model as it is
    DDP = "ddp"  # pure data parallelism: DistributedDataParallel
    FULLY_SHARD = "fully_shard"  # FSDP, HSDP, TP + FSDP as torchtitan composes them
    TENSOR = "tensor"  # data x tensor parallel without FSDP: parallelize_module's styles (torchtitan's DDP + TP)
    DTENSOR = "dtensor"  # every other plan: per-layer DTensor placements


KIND = "commtune.plan"
VERSION = 1
WHAT = "typed plan"
FIX = "convert the search's plan.json with autotune.plan.load_plan (or re-run python -m autotune --out DIR)"
SEARCH_KIND = "commtune.sbp-plan"  # plan.json of python -m autotune, converted on load
RECOMPUTE = ("none", "selective", "full")
SHARDING = ("none", "fsdp")


def _bad(where: str, problem: str) -> UserError:
    return UserError(f"{where}: {problem}; {FIX}")


def _number(v, where: str, low: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low:
        raise _bad(where, f"{v!r} is not a finite number >= {low:g}")
    return float(v)


def _count(v, where: str, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _bad(where, f"{v!r} is not an integer >= {low}")
    return v


def _text(v, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise _bad(where, f"{v!r} is not a non-empty string")
    return v


def _dict(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise _bad(where, f"{type(v).__name__} is not an object")
    return v


def _list(v, where: str) -> list:
    if not isinstance(v, list):
        raise _bad(where, f"{type(v).__name__} is not a list")
    return v


def dtensor_placement(p: str) -> str:
    """PyTorch's spelling of one placement: Shard(d), Replicate() or Partial()."""
    return f"Shard({split_dim(p)})" if is_split(p) else "Replicate()" if p == B else "Partial()"


def check_placements(v, rank: int | None, axes: int, where: str) -> tuple[str, ...]:
    """One SBP placement per fine axis; a split names a dimension of a tensor of ``rank`` dimensions."""
    items = _list(v, where)
    if len(items) != axes:
        raise _bad(where, f"{len(items)} placements for a mesh of {axes} fine axes")
    for p in items:
        ok = p in (B, P) or (isinstance(p, str) and p[:1] == "S" and p[1:].isdigit() and
                             (rank is None or int(p[1:]) < rank))
        if not ok:
            raise _bad(where, f"placement {p!r} is not B, P or S<d> with d below {rank}")
    return tuple(items)


@dataclass(frozen=True)
class ModelSpec:
    kind: str
    config: dict  # the model's fields (layers, hidden, heads, ...), as models.loader reads them

    def get(self, key: str, default=None):
        return self.config.get(key, default)


@dataclass(frozen=True)
class FineMesh:
    """The DeviceMesh every layer lives on: one dimension per fine axis (node axes first)."""

    sizes: tuple[int, ...]
    names: tuple[str, ...]

    @classmethod
    def of(cls, cluster: Cluster) -> "FineMesh":
        n = len(cluster.node_axes)
        if not cluster.axis_sizes:  # one device: a single axis of size 1
            return cls((1,), ("g0",))
        return cls(cluster.axis_sizes, tuple(f"n{i}" for i in range(n)) +
                   tuple(f"g{i}" for i in range(len(cluster.gpu_axes))))

    @property
    def devices(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class WeightPlan:
    name: str
    shape: tuple[int, ...]
    placements: tuple[str, ...]


@dataclass(frozen=True)
class LayerPlan:
    """One distinct layer (tied across its ``count`` occurrences) and its placements per fine axis."""

    name: str
    kind: str
    count: int
    dims: dict  # the layer's dims (tokens, k, n, hidden, heads, ...)
    signature: str
    input: tuple[str, ...] | None
    output: tuple[str, ...] | None
    weights: tuple[WeightPlan, ...] = ()
    costs: dict = field(default_factory=dict)  # predicted seconds and bytes (redistribution_s, memory_bytes, ...)
    roles: tuple[tuple[int, int], ...] = ()  # the search's role mesh, (nodes, gpus) per role (names the strategy)

    def weight(self, name: str) -> WeightPlan | None:
        return next((w for w in self.weights if w.name == name), None)


@dataclass(frozen=True)
class Costs:
    """Predicted costs of one step: seconds, peak memory per device and its breakdown."""

    redistribution_s: float
    grad_sync_s: float
    total_s: float
    memory_bytes: float
    fits_memory: bool
    memory: dict = field(default_factory=dict)  # parameters_bytes, gradients_bytes, ...
    extra: dict = field(default_factory=dict)  # compute_s, exposed_comm_s, step_s when the step model ran

    def to_dict(self) -> dict:
        return {"redistribution_s": self.redistribution_s, "grad_sync_s": self.grad_sync_s,
                "total_s": self.total_s, "memory_bytes": self.memory_bytes, "fits_memory": self.fits_memory,
                "memory": dict(self.memory), **self.extra}

    @classmethod
    def from_dict(cls, d, where: str) -> "Costs":
        d = _dict(d, where)
        for key in ("redistribution_s", "grad_sync_s", "total_s", "memory_bytes", "fits_memory"):
            if key not in d:
                raise _bad(where, f"no {key!r}")
        if not isinstance(d["fits_memory"], bool):
            raise _bad(f"{where}.fits_memory", f"{d['fits_memory']!r} is not true or false")
        # the workspace may be negative: with one micro-batch, the gradients not yet made at the peak
        # (autotune.sbp.memory.peak_workspace)
        memory = {k: _number(v, f"{where}.memory.{k}", -math.inf if k == "workspace_bytes" else 0.0)
                  for k, v in _dict(d.get("memory", {}), f"{where}.memory").items()}
        known = {"redistribution_s", "grad_sync_s", "total_s", "memory_bytes", "fits_memory", "memory"}
        extra = {k: _number(v, f"{where}.{k}") for k, v in d.items() if k not in known}
        return cls(*(_number(d[k], f"{where}.{k}") for k in ("redistribution_s", "grad_sync_s", "total_s",
                                                             "memory_bytes")), d["fits_memory"], memory, extra)


@dataclass(frozen=True)
class Baseline:
    strategy: str
    costs: Costs


@dataclass(frozen=True)
class TypedPlan:
    model: ModelSpec
    cluster: Cluster
    mesh: FineMesh
    layers: tuple[LayerPlan, ...]
    micro_batches: int = 1
    recompute: str = "none"
    sharding_mode: str = "none"
    sharding_axes: tuple[int, ...] = ()
    strategy: str = ""
    profile: str = ""
    costs: Costs | None = None
    baselines: tuple[Baseline, ...] = ()

    def __post_init__(self):
        check(self)

    def layer(self, name: str) -> LayerPlan | None:
        return next((lay for lay in self.layers if lay.name == name), None)

    @property
    def world(self) -> int:
        return self.mesh.devices

    # --- the record -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        def placements(t):
            return None if t is None else list(t)
        return {
            **header(KIND, VERSION), "strategy": self.strategy, "profile": self.profile,
            "model": {"kind": self.model.kind, **self.model.config},
            "cluster": {"nodes": self.cluster.nodes, "gpus_per_node": self.cluster.gpus_per_node},
            "mesh": {"sizes": list(self.mesh.sizes), "names": list(self.mesh.names)},
            "micro_batches": self.micro_batches, "recompute": self.recompute,
            "sharding": {"mode": self.sharding_mode, "axes": list(self.sharding_axes)},
            "layers": [{"name": lay.name, "kind": lay.kind, "count": lay.count, "dims": dict(lay.dims),
                        "signature": lay.signature, "input": placements(lay.input),
                        "output": placements(lay.output),
                        "weights": [{"name": w.name, "shape": list(w.shape), "placements": list(w.placements)}
                                    for w in lay.weights],
                        "costs": dict(lay.costs), "roles": [list(r) for r in lay.roles]} for lay in self.layers],
            "costs": self.costs.to_dict() if self.costs else None,
            "baselines": [{"strategy": b.strategy, "costs": b.costs.to_dict()} for b in self.baselines],
        }

    @classmethod
    def from_dict(cls, d, origin: str = "plan") -> "TypedPlan":
        check_header(d, KIND, VERSION, WHAT, FIX, origin)
        m = _dict(d.get("model"), f"{origin}: model")
        cl = _dict(d.get("cluster"), f"{origin}: cluster")
        cluster = Cluster(_count(cl.get("nodes"), f"{origin}: cluster.nodes"),
                          _count(cl.get("gpus_per_node"), f"{origin}: cluster.gpus_per_node"))
        me = _dict(d.get("mesh"), f"{origin}: mesh")
        mesh = FineMesh(tuple(_count(s, f"{origin}: mesh.sizes") for s in _list(me.get("sizes"), f"{origin}: mesh.sizes")),
                        tuple(_text(s, f"{origin}: mesh.names") for s in _list(me.get("names"), f"{origin}: mesh.names")))
        if mesh != FineMesh.of(cluster):
            want = FineMesh.of(cluster)
            raise _bad(f"{origin}: mesh", f"sizes {list(mesh.sizes)} names {list(mesh.names)} are not the fine axes "
                                          f"of {cluster} (sizes {list(want.sizes)}, names {list(want.names)})")
        layers = []
        for i, e in enumerate(_list(d.get("layers"), f"{origin}: layers")):
            where = f"{origin}: layer {i}"
            e = _dict(e, where)
            axes = len(mesh.sizes)
            weights = []
            for w in _list(e.get("weights", []), f"{where}.weights"):
                w = _dict(w, f"{where}.weights")
                shape = tuple(_count(s, f"{where}.weights.shape") for s in _list(w.get("shape"), f"{where}.weights.shape"))
                weights.append(WeightPlan(_text(w.get("name"), f"{where}.weights.name"), shape,
                                          check_placements(w.get("placements"), len(shape), axes, f"{where}.weights")))
            costs = {k: _number(v, f"{where}.costs.{k}") for k, v in _dict(e.get("costs", {}), f"{where}.costs").items()}
            dims = {k: _count(v, f"{where}.dims.{k}", 0) for k, v in _dict(e.get("dims", {}), f"{where}.dims").items()}
            roles = tuple(tuple(_count(x, f"{where}.roles") for x in _list(r, f"{where}.roles"))
                          for r in _list(e.get("roles", []), f"{where}.roles"))
            if any(len(r) != 2 for r in roles):
                raise _bad(f"{where}.roles", "each role is [nodes, gpus]")
            layers.append(LayerPlan(
                _text(e.get("name"), f"{where}.name"), _text(e.get("kind"), f"{where}.kind"),
                _count(e.get("count"), f"{where}.count"), dims, _text(e.get("signature"), f"{where}.signature"),
                None if e.get("input") is None else check_placements(e["input"], None, axes, f"{where}.input"),
                None if e.get("output") is None else check_placements(e["output"], None, axes, f"{where}.output"),
                tuple(weights), costs, roles))
        sh = _dict(d.get("sharding", {"mode": "none", "axes": []}), f"{origin}: sharding")
        baselines = tuple(Baseline(_text(_dict(b, f"{origin}: baselines").get("strategy"), f"{origin}: baselines.strategy"),
                                   Costs.from_dict(b.get("costs"), f"{origin}: baselines.costs"))
                          for b in _list(d.get("baselines", []), f"{origin}: baselines"))
        return cls(
            ModelSpec(_text(m.get("kind"), f"{origin}: model.kind"), {k: v for k, v in m.items() if k != "kind"}),
            cluster, mesh, tuple(layers), _count(d.get("micro_batches", 1), f"{origin}: micro_batches"),
            d.get("recompute", "none"), sh.get("mode"), tuple(_list(sh.get("axes", []), f"{origin}: sharding.axes")),
            d.get("strategy", ""), d.get("profile", ""),
            None if d.get("costs") is None else Costs.from_dict(d["costs"], f"{origin}: costs"), baselines)

    def save(self, path: str | Path) -> Path:
        return write_json(Path(path), self.to_dict(), WHAT)


def check(plan: TypedPlan) -> None:
    """Every cross-field rule of a typed plan (the loader's and the constructor's)."""
    cl, mesh = plan.cluster, plan.mesh
    if mesh != FineMesh.of(cl):
        want = FineMesh.of(cl)
        raise _bad("mesh", f"sizes {list(mesh.sizes)} names {list(mesh.names)} are not the fine axes of {cl} "
                           f"(sizes {list(want.sizes)}, names {list(want.names)})")
    if plan.recompute not in RECOMPUTE:
        raise _bad("recompute", f"{plan.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if plan.sharding_mode not in SHARDING:
        raise _bad("sharding.mode", f"{plan.sharding_mode!r} is not one of {', '.join(SHARDING)}")
    for a in plan.sharding_axes:
        if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < len(mesh.sizes):
            raise _bad("sharding.axes", f"{a!r} is not a fine axis index below {len(mesh.sizes)}")
    if plan.sharding_mode == "none" and plan.sharding_axes:
        raise _bad("sharding.axes", "axes given with mode 'none'")
    if not isinstance(plan.model.kind, str) or not plan.model.kind:
        raise _bad("model.kind", "missing")
    names = [lay.name for lay in plan.layers]
    if len(set(names)) != len(names):
        raise _bad("layers", f"a layer name repeats in {names}")
    axes = len(mesh.sizes)
    for lay in plan.layers:
        for what, t in (("input", lay.input), ("output", lay.output)):
            if t is not None and len(t) != axes:
                raise _bad(f"layer {lay.name}.{what}", f"{len(t)} placements for {axes} fine axes")
        for w in lay.weights:
            if len(w.placements) != axes:
                raise _bad(f"layer {lay.name} weight {w.name}", f"{len(w.placements)} placements for {axes} fine axes")
            for p, n in zip(w.placements, mesh.sizes):
                if is_split(p) and w.shape[split_dim(p)] % n:
                    raise _bad(f"layer {lay.name} weight {w.name}", f"{p} over {n} does not divide shape {list(w.shape)}")


def read_source(source, origin: str | None, fix: str) -> tuple[object, str]:
    """(the plan as parsed JSON, where it came from): ``source`` read where it is a path (``fix``: what to give
    instead when it cannot be read), as it is otherwise."""
    if isinstance(source, (str, Path)):
        return read_json(source, "plan file", fix), origin or f"plan file {str(source)!r}"
    return source, origin or "plan"
