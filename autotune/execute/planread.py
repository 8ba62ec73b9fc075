"""Read a plan for execution: the model it was made for and, per distinct layer,
the fine-axis placements of its input, output and weights (as the plan states
them) and the boxings inside it (from its signature's strategy)."""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.errors import OptionError, UserError
from models.builders import BUILDERS
from models.graph import Layer, LayerGraph
from models.loader import FIELDS, OPTIONAL, validate

from autotune.sbp.layers import Matmul, make_op
from autotune.sbp.mesh import Cluster, RoleMesh
from autotune.sbp.sbp import NdSbp, parse

KINDS = ("gpt", "mlp", "u-transformer")  # models whose layer kinds execute knows


@dataclass(frozen=True)
class Internal:
    tensor: str
    shape: tuple[int, ...]
    src: tuple[str, ...]
    dst: tuple[str, ...]


@dataclass(frozen=True)
class LayerSpec:
    layer: Layer
    signature: str
    input: tuple[str, ...] | None  # fine placements
    output: tuple[str, ...] | None
    weights: tuple[tuple[str, tuple[int, ...], tuple[str, ...]], ...]  # (name, shape, fine placements)
    internal: tuple[Internal, ...]
    in_shape: tuple[int, ...] | None
    out_shape: tuple[int, ...] | None
    grad_in: tuple[str, ...] | None  # placement of the input's gradient the layer returns (the dual, or its own)

    @property
    def kind(self) -> str:
        return self.layer.kind


def model_kind(cfg: dict) -> str:
    if cfg.get("kind") in BUILDERS:
        return cfg["kind"]
    for kind, fields in FIELDS.items():
        if set(fields) - OPTIONAL <= set(cfg):
            return kind
    raise UserError("the plan's model section names no known model: re-run the search (python -m autotune --out DIR)")


def plan_graph(plan: dict, layers: int | None = None) -> LayerGraph:
    """The model a plan was searched for; ``layers`` runs a shorter (or longer) stack of its tied layers."""
    cfg = dict(plan.get("model") or {})
    kind = model_kind(cfg)
    if kind not in KINDS:
        raise UserError(f"execute runs plans of {', '.join(KINDS)} models, not {kind}: search a plan for one of those")
    cfg = {k: v for k, v in cfg.items() if k in FIELDS[kind] or k in ("name", "source", "description")}
    if layers is not None:
        if kind != "gpt":
            raise OptionError("layers", f"applies to gpt plans; this plan is for a {kind} model: drop it")
        if layers < 1:
            raise OptionError("layers", "must be at least 1")
        cfg["layers"] = layers
    return BUILDERS[kind](validate(kind, cfg, "the plan's model"))


def _fine(text: str, cluster: Cluster, where: str) -> tuple[str, ...]:
    try:
        fine = parse(text, cluster).fine(cluster)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    return fine if fine else ("B",)  # one device: a single axis of size 1


def _strategy(layer: Layer, signature: str, mesh: RoleMesh, cluster: Cluster, act_bytes: int):
    op = make_op(layer, act_bytes)
    if isinstance(op, Matmul):
        return op.build(signature, mesh)
    for s in op.strategies(cluster):
        if s.signature == signature and s.mesh == mesh:
            return s
    raise UserError(f"layer {layer.name}: signature {signature!r} on mesh {[list(m) for m in mesh.sizes]} is not "
                    f"a strategy of a {layer.kind} layer on {cluster}: re-run the search")


def layer_specs(plan: dict, graph: LayerGraph, cluster: Cluster) -> list[LayerSpec]:
    entries = plan.get("layers") or []
    names = [e.get("name") for e in entries]
    want = [layer.name for layer in graph.layers]
    if names != want:
        raise UserError(f"the plan's layers {names[:4]}... are not the model's {want[:4]}...: "
                        f"give the plan.json searched for this model")
    out = []
    for layer, e in zip(graph.layers, entries):
        try:
            mesh = RoleMesh(tuple(tuple(m) for m in e["mesh"]))
            sbp, sig = e["sbp"], e["signature"]
        except (KeyError, TypeError):
            raise UserError(f"layer {layer.name} of the plan lacks mesh, sbp or signature: re-run the search") from None
        where = f"layer {layer.name}"
        strat = _strategy(layer, sig, mesh, cluster, graph.act_bytes)
        shapes = {w.name: w.shape for w in strat.weights}
        weights = []
        for name, text in sbp.get("weights", {}).items():
            if name not in shapes:
                raise UserError(f"{where}: the plan places a weight {name!r} that a {layer.kind} layer has not: re-run the search")
            weights.append((name, shapes[name], _fine(text, cluster, where)))
        internal = tuple(Internal(it.tensor, it.shape, _fine_roles(it.src, mesh, cluster), _fine_roles(it.dst, mesh, cluster))
                         for it in strat.internal if it.direction == "fwd")
        out.append(LayerSpec(
            layer, sig,
            _fine(sbp["input"], cluster, where) if "input" in sbp else None,
            _fine(sbp["output"], cluster, where) if "output" in sbp else None,
            tuple(weights), internal, strat.input.shape if strat.input else None,
            strat.output.shape if strat.output else None,
            _fine_roles(strat.grad_in, mesh, cluster) if strat.grad_in else None))
    return out


def _fine_roles(roles: tuple[str, ...], mesh: RoleMesh, cluster: Cluster) -> tuple[str, ...]:
    return NdSbp(roles, mesh).fine(cluster) or ("B",)
