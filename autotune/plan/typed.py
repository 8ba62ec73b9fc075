"""The plan: one dataclass tree for everything a plan tells a user, built by the search
(``autotune.plan.build``) and written as plan.json (``autotune.plan.file.PlanFile``) with one validating loader.

``Plan`` holds the model (kind and config fields), the cluster, the fine mesh (one DeviceMesh dimension per
fine axis of the cluster, node axes first: ``autotune.sbp.mesh``), per distinct layer its placements per fine
axis ("S0", "S1", ... split, "B" replicated, "P" partial sum) of input, output and each weight with the weight's
shape, the collectives it issues and its predicted costs, the boxings between layers (``edges``),
recomputation, FSDP sharding, micro-batches, the path ``apply`` places it by (``ApplyPath``, decided once by the
search) and the predicted costs of a step (``Costs``). A pipelined plan has no layers of its own: its ``stages``
each hold the plan of the layers they run on their submesh, and ``pipeline`` the schedule and the split.

    plan = load_plan("plan.json")          # the best plan of python -m autotune's plan.json (autotune.plan.file)
    plan.costs.step_s, plan.apply_path, [s.plan.apply_path for s in plan.stages]

Placements are the SBP strings of ``autotune.sbp.sbp``; ``dtensor_placement`` spells them as PyTorch's
``Shard``/``Replicate``/``Partial`` (without importing torch).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path

from calibrate.allocator import ALLOCATORS
from calibrate.errors import UserError
from calibrate.jsonfile import write_json
from models.builders import BUILDERS
from models.graph import LayerGraph
from models.loader import FIELDS, validate

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
    PIPELINE = "pipeline"  # a pipelined plan: each stage by its own plan's path (autotune.apply_pipeline)


FIX = "re-run python -m autotune --out DIR"
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

    def graph(self, layers: int | None = None) -> LayerGraph:
        """The model's layer graph; ``layers`` overrides its number of blocks."""
        if self.kind not in BUILDERS:
            raise UserError(f"the plan's model kind {self.kind!r} is not one of {', '.join(BUILDERS)}: {FIX}")
        cfg = {k: v for k, v in self.config.items() if k in FIELDS[self.kind] or k in ("name", "source", "description")}
        return BUILDERS[self.kind](validate(self.kind, cfg if layers is None else dict(cfg, layers=layers),
                                            "the plan's model"))


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


def _record(cls, d, where: str, numbers: tuple[str, ...] = ()):
    """A flat record dataclass from its dict: its fields by name, ``numbers`` finite and not negative, lists
    as tuples."""
    d = _dict(d, where)
    names = {f.name for f in fields(cls)}
    if set(d) - names:
        raise _bad(where, f"unknown fields {sorted(set(d) - names)}")
    try:
        return cls(**{k: _number(v, f"{where}.{k}") if k in numbers and v is not None else
                      tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
                      for k, v in d.items()})
    except TypeError:
        raise _bad(where, f"lacks some of {sorted(names)}") from None


def _flat(x) -> dict:
    """A flat record dataclass as its dict (tuples as lists; None fields left out)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(x).items() if v is not None}


@dataclass(frozen=True)
class Collective:
    """One collective a layer or boxing issues: what it moves (``phase`` internal, grad-sync, fsdp or boxing;
    ``tensor``; ``direction`` fwd or bwd; ``per`` micro-batch or step), on which group, and its predicted
    seconds."""

    phase: str
    tensor: str
    direction: str
    per: str
    collective: str
    axes: tuple[int, ...]
    ranks: int
    nodes: int
    tier: str
    nbytes: float
    seconds: float


COLLECTIVE_NUMBERS = ("ranks", "nodes", "nbytes", "seconds")


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
    collectives: tuple[Collective, ...] = ()
    compute_source: str = ""  # "module" (the user's module as measured), "nearest" or "analytical"; "" unpriced

    def weight(self, name: str) -> WeightPlan | None:
        return next((w for w in self.weights if w.name == name), None)


@dataclass(frozen=True)
class Edge:
    """The boxing from one layer's output to the next layer's input: its collectives and seconds per step
    (``costs``: redistribution_s; with compute figures copy_s, forward_s, backward_s)."""

    source: str
    target: str
    count: int
    collectives: tuple[Collective, ...] = ()
    costs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Costs:
    """Predicted costs of one step: seconds, peak memory per device and its breakdown; the step model's
    figures where it ran (``step_s`` at the host's pace and corrected by the profile's residual where those
    apply: ``autotune.plan.hostpace``), a pipeline's where pipelined."""

    redistribution_s: float
    grad_sync_s: float
    total_s: float
    memory_bytes: float
    fits_memory: bool
    memory: dict = field(default_factory=dict)  # parameters_bytes, gradients_bytes, ...
    compute_s: float | None = None
    exposed_comm_s: float | None = None
    step_s: float | None = None
    host_step_s: float | None = None  # the host's time to issue the step on the plan's path
    path_s: float | None = None  # the device's work of the plan's path beyond its layers', in step_s (hostpace)
    gather_exposed_s: float | None = None  # fully_shard: the forward all-gathers' exposed part of exposed_comm_s
    fsdp_serial_s: float | None = None  # the DTensor path: FSDP's collectives in series with the compute, in it
    step_uncorrected_s: float | None = None  # the step before the residual
    residual: float | None = None  # measured / predicted steps of the path (calibrate.residuals)
    boundary_s: float | None = None  # pipelined: the boundary transfers of a micro-batch, both ways
    boundary_planned_s: float | None = None
    bubble_s: float | None = None
    memory_stage: int | None = None  # pipelined: the stage whose memory binds

    def to_dict(self) -> dict:
        return _flat(self)

    def of(self, objective: str) -> float | None:
        """The seconds ``objective`` minimises: the step ("step") or the communication ("comm")."""
        return self.step_s if objective == "step" else self.total_s

    @classmethod
    def from_dict(cls, d, where: str) -> "Costs":
        d = dict(_dict(d, where))
        if not isinstance(d.get("fits_memory"), bool):
            raise _bad(f"{where}.fits_memory", f"{d.get('fits_memory')!r} is not true or false")
        # the workspace may be negative: with one micro-batch, the gradients not yet made at the peak
        # (autotune.sbp.memory.peak_workspace)
        d["memory"] = {k: _number(v, f"{where}.memory.{k}", -math.inf if k == "workspace_bytes" else 0.0)
                       for k, v in _dict(d.get("memory", {}), f"{where}.memory").items()}
        if d.get("memory_stage") is not None:
            _count(d["memory_stage"], f"{where}.memory_stage", 0)
        return _record(cls, d, where, tuple(f.name for f in fields(cls)
                                            if f.name not in ("fits_memory", "memory", "memory_stage")))


@dataclass(frozen=True)
class Pipeline:
    """A pipelined plan's schedule: its order, blocks per stage, the simulated makespan, each stage's peak of
    micro-batches in flight and the steady state."""

    schedule: str
    split: tuple[int, ...]
    makespan_s: float
    peak_activations: tuple[int, ...] = ()
    steady: tuple = ()


@dataclass(frozen=True)
class Stage:
    """One stage of a pipelined plan: its plan (the layers it runs, on its submesh), its chain range and blocks,
    the micro-batches it holds in flight, per micro-batch forward and backward, the boundary to the next stage
    (seconds each way as it executes, by ``boundary_route``, direct or scatter, whose tiles cross in
    ``boundary_sent``; as the resharding planner would move it: ``boundary_planned_*``; None routes on the last
    stage), gradient sync, optimizer, the simulated end of its last backward, memory and its timeline (kind,
    micro-batch, start, end)."""

    plan: "Plan"
    chain: tuple[int, int]
    blocks: int
    first_layer: str
    last_layer: str
    inflight: int
    forward_s: float
    backward_s: float
    boundary_forward_s: float
    boundary_backward_s: float
    boundary_planned_forward_s: float
    boundary_planned_backward_s: float
    grad_sync_s: float
    exposed_sync_s: float
    optimizer_s: float
    end_s: float
    memory_bytes: float
    fits_memory: bool
    boundary_route: str | None = None
    boundary_sent: tuple[str, ...] | None = None
    host_pass_s: float | None = None  # the host's seconds to issue a micro-batch on the stage's path
    timeline: tuple = ()
    techniques: dict = field(default_factory=dict)  # autotune.sbp.techniques.Techniques.to_dict()

    @property
    def virtual_stages(self) -> int:
        """The chunks the stage's ranks run (Megatron-LM's virtual pipeline stages; 1 but under interleaved 1F1B)."""
        return self.techniques.get("virtual_stages", 1)

    @property
    def zero_stage(self) -> int:
        """The stage's ZeRO stage (1: optimizer states, 2: and gradients, sharded over its data ranks; 0: none)."""
        return self.techniques.get("zero_stage", 0)


STAGE_NUMBERS = tuple(f.name for f in fields(Stage) if f.name.endswith("_s") or f.name == "memory_bytes")


@dataclass(frozen=True)
class Plan:
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
    apply_path: str = ""  # an ApplyPath value, decided once by the search; "" where it did not price paths
    objective: str = ""  # what the search minimised: "comm" or "step"
    memory_limit_bytes: float | None = None
    search: dict = field(default_factory=dict)  # the search's algorithm, seconds, steps, why it stopped
    edges: tuple[Edge, ...] = ()
    pipeline: Pipeline | None = None
    stages: tuple[Stage, ...] = ()
    tune: dict = field(default_factory=dict)  # autotune tune's measurement of the plan it returned
    allocator: str = "default"  # calibrate.allocator.ALLOCATORS: the allocator whose allowance the memory limit left
    # with full recomputation: only the first this many blocks re-run (Megatron-LM's --recompute-method block
    # --recompute-num-layers; a pipeline stage's own first blocks); 0: every block
    recompute_blocks: int = 0

    def __post_init__(self):
        check(self)

    def layer(self, name: str) -> LayerPlan | None:
        return next((lay for lay in self.layers if lay.name == name), None)

    @property
    def world(self) -> int:
        return self.mesh.devices

    @property
    def virtual_stages(self) -> int:
        """The chunks each rank of a pipelined plan runs (Megatron-LM's virtual pipeline stages; 1 but under
        interleaved 1F1B)."""
        return self.stages[0].virtual_stages if self.stages else 1

    def chunk_ranges(self) -> list[tuple[int, int]]:
        """Per virtual stage s (rank s mod p, its chunk s // p), the model's blocks it runs, [lo, hi): rank i's
        split[i] blocks in v chunks as even as they go (the first ones one more), laid along the model in virtual
        stage order (Megatron-LM's interleaved assignment; with one chunk, stage i's blocks)."""
        p, v, split = len(self.stages), self.virtual_stages, self.pipeline.split
        out, lo = [], 0
        for s in range(p * v):
            n = split[s % p] // v + (s // p < split[s % p] % v)
            out.append((lo, lo + n))
            lo += n
        return out

    @property
    def submesh(self) -> Cluster:
        """A pipelined plan's stages' cluster (the plan's own for one stage)."""
        return self.stages[0].plan.cluster if self.stages else self.cluster

    @property
    def compute_source(self) -> str:
        """"module" where every layer's compute is priced from the user's module as measured at its shape
        (``autotune.sbp.modulecal``; "nearest": at the nearest measured tensor width), "analytical" where none is,
        else the sources joined ("module+nearest", "module+analytical", ...)."""
        found = {lay.compute_source or "analytical" for p in [s.plan for s in self.stages] or [self] for lay in p.layers}
        order = ("module", "nearest", "analytical")
        return "+".join(x for x in order if x in found) or "analytical"

    # --- the record -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        def placements(t):
            return None if t is None else list(t)
        return {
            "strategy": self.strategy, "profile": self.profile,
            "model": {"kind": self.model.kind, **self.model.config},
            "cluster": {"nodes": self.cluster.nodes, "gpus_per_node": self.cluster.gpus_per_node},
            "mesh": {"sizes": list(self.mesh.sizes), "names": list(self.mesh.names)},
            "micro_batches": self.micro_batches, "recompute": self.recompute,
            **({"recompute_blocks": self.recompute_blocks} if self.recompute_blocks else {}),
            "sharding": {"mode": self.sharding_mode, "axes": list(self.sharding_axes)},
            "apply_path": self.apply_path, "objective": self.objective,
            "memory_limit_bytes": self.memory_limit_bytes, "allocator": self.allocator, "search": self.search,
            "tune": self.tune,
            "layers": [{"name": lay.name, "kind": lay.kind, "count": lay.count, "dims": dict(lay.dims),
                        "signature": lay.signature, "input": placements(lay.input),
                        "output": placements(lay.output),
                        "weights": [{"name": w.name, "shape": list(w.shape), "placements": list(w.placements)}
                                    for w in lay.weights],
                        "costs": dict(lay.costs), "roles": [list(r) for r in lay.roles],
                        "collectives": [_flat(c) for c in lay.collectives], "compute_source": lay.compute_source}
                       for lay in self.layers],
            "edges": [dict(_flat(e), collectives=[_flat(c) for c in e.collectives]) for e in self.edges],
            "costs": self.costs.to_dict() if self.costs else None,
            "pipeline": _flat(self.pipeline) if self.pipeline else None,
            "stages": [dict(_flat(s), plan=s.plan.to_dict()) for s in self.stages],
        }

    @classmethod
    def from_dict(cls, d, origin: str = "plan") -> "Plan":
        d = _dict(d, origin)
        m = _dict(d.get("model"), f"{origin}: model")
        cl = _dict(d.get("cluster"), f"{origin}: cluster")
        cluster = Cluster(_count(cl.get("nodes"), f"{origin}: cluster.nodes"),
                          _count(cl.get("gpus_per_node"), f"{origin}: cluster.gpus_per_node"))
        me = _dict(d.get("mesh"), f"{origin}: mesh")
        mesh = FineMesh(tuple(_count(s, f"{origin}: mesh.sizes") for s in _list(me.get("sizes"), f"{origin}: mesh.sizes")),
                        tuple(_text(s, f"{origin}: mesh.names") for s in _list(me.get("names"), f"{origin}: mesh.names")))
        if mesh != FineMesh.of(cluster):
            raise _bad(f"{origin}: mesh", f"sizes {list(mesh.sizes)} are not the fine axes of {cluster}")
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
                tuple(weights), costs, roles, _collectives(e.get("collectives", []), f"{where}.collectives"),
                str(e.get("compute_source", ""))))
        edges = tuple(Edge(_text(x.get("source"), f"{origin}: edge.source"), _text(x.get("target"), f"{origin}: edge.target"),
                           _count(x.get("count"), f"{origin}: edge.count"),
                           _collectives(x.get("collectives", []), f"{origin}: edge.collectives"),
                           {k: _number(v, f"{origin}: edge.costs.{k}") for k, v in _dict(x.get("costs", {}), f"{origin}: edge.costs").items()})
                      for x in (_dict(x, f"{origin}: edges") for x in _list(d.get("edges", []), f"{origin}: edges")))
        stages = []
        for i, s in enumerate(_list(d.get("stages", []), f"{origin}: stages")):
            s = dict(_dict(s, f"{origin}: stage {i}"))
            s["plan"] = cls.from_dict(s.get("plan"), f"{origin}: stage {i}'s plan")
            for key in ("blocks", "inflight"):
                _count(s.get(key), f"{origin}: stage {i}.{key}")
            stages.append(_record(Stage, s, f"{origin}: stage {i}", STAGE_NUMBERS))
        sh = _dict(d.get("sharding", {"mode": "none", "axes": []}), f"{origin}: sharding")
        limit = d.get("memory_limit_bytes")
        return cls(
            ModelSpec(_text(m.get("kind"), f"{origin}: model.kind"), {k: v for k, v in m.items() if k != "kind"}),
            cluster, mesh, tuple(layers), _count(d.get("micro_batches", 1), f"{origin}: micro_batches"),
            d.get("recompute", "none"), sh.get("mode"), tuple(_list(sh.get("axes", []), f"{origin}: sharding.axes")),
            d.get("strategy", ""), d.get("profile", ""),
            None if d.get("costs") is None else Costs.from_dict(d["costs"], f"{origin}: costs"),
            d.get("apply_path", ""), d.get("objective", ""),
            None if limit is None else _number(limit, f"{origin}: memory_limit_bytes"),
            _dict(d.get("search", {}), f"{origin}: search"), edges,
            None if d.get("pipeline") is None else _record(Pipeline, d["pipeline"], f"{origin}: pipeline", ("makespan_s",)),
            tuple(stages), _dict(d.get("tune", {}), f"{origin}: tune"), allocator=d.get("allocator", "default"),
            recompute_blocks=d.get("recompute_blocks", 0))

    def save(self, path: str | Path) -> Path:
        return write_json(Path(path), self.to_dict(), "plan")


TypedPlan = Plan  # the name the apply layer's modules and older scripts use


def _collectives(v, where: str) -> tuple[Collective, ...]:
    return tuple(_record(Collective, c, where, COLLECTIVE_NUMBERS) for c in _list(v, where))


def check(plan: Plan) -> None:
    """Every cross-field rule of a typed plan (the loader's and the constructor's)."""
    cl, mesh = plan.cluster, plan.mesh
    if mesh != FineMesh.of(cl):
        want = FineMesh.of(cl)
        raise _bad("mesh", f"sizes {list(mesh.sizes)} names {list(mesh.names)} are not the fine axes of {cl} "
                           f"(sizes {list(want.sizes)}, names {list(want.names)})")
    if plan.recompute not in RECOMPUTE:
        raise _bad("recompute", f"{plan.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    n = plan.recompute_blocks
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n and (plan.recompute != "full"
                                                                        or plan.sharding_mode != "none"):
        raise _bad("recompute_blocks", f"{n!r}: a count of blocks (0: every block), with recompute 'full' and no "
                                       f"FSDP sharding (Megatron-LM's block method)")
    if plan.sharding_mode not in SHARDING:
        raise _bad("sharding.mode", f"{plan.sharding_mode!r} is not one of {', '.join(SHARDING)}")
    for a in plan.sharding_axes:
        if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < len(mesh.sizes):
            raise _bad("sharding.axes", f"{a!r} is not a fine axis index below {len(mesh.sizes)}")
    if plan.sharding_mode == "none" and plan.sharding_axes:
        raise _bad("sharding.axes", "axes given with mode 'none'")
    if not isinstance(plan.model.kind, str) or not plan.model.kind:
        raise _bad("model.kind", "missing")
    for key in ("strategy", "profile", "apply_path", "objective"):
        if not isinstance(getattr(plan, key), str):
            raise _bad(key, f"{getattr(plan, key)!r} is not a string")
    if plan.allocator not in ALLOCATORS:
        raise _bad("allocator", f"{plan.allocator!r} is not one of {', '.join(ALLOCATORS)}")
    for key, typ in FIELDS.get(plan.model.kind, {}).items():
        if typ == "int" and key in plan.model.config:
            _count(plan.model.config[key], f"model.{key}")
    if not isinstance(plan.search, dict):
        raise _bad("search", f"{plan.search!r} is not an object")
    if not plan.layers and not plan.stages:
        raise _bad("layers", "is empty: a plan of one stage places the model's layers")
    if plan.apply_path and plan.apply_path not in set(ApplyPath):
        raise _bad("apply_path", f"{plan.apply_path!r} is not one of {', '.join(ApplyPath)}")
    if plan.stages and (plan.pipeline is None or len(plan.pipeline.split) != len(plan.stages) or plan.layers):
        raise _bad("stages", f"{len(plan.stages)} stages need a pipeline section of as many blocks per stage and "
                             f"no layers of the whole plan's own")
    for i, st in enumerate(plan.stages):
        if st.plan.recompute_blocks and st.plan.recompute_blocks >= st.blocks:
            raise _bad(f"stage {i}'s recompute_blocks", f"{st.plan.recompute_blocks} of its {st.blocks} blocks: "
                                                        f"fewer than all (all: 0)")
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


