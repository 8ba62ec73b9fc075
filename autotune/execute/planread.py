"""Read a plan for execution: the model it was made for and, per distinct layer,
the fine-axis placements of its input, output and weights (through the typed
plan, ``autotune.plan``) and the boxings inside it (from its signature's strategy)."""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.errors import OptionError, UserError
from models.graph import Layer, LayerGraph

from autotune.plan.search import convert, model_graph, model_kind, strategy
from autotune.plan.typed import ApplyPath
from autotune.sbp.mesh import Cluster, RoleMesh
from autotune.sbp.sbp import NdSbp

KINDS = ("gpt", "mlp", "u-transformer")  # models whose layer kinds execute knows
# where apply places a plan: "auto", the path it takes; "dtensor", data-parallel plans and pipeline stages by
# DTensor too (the same plan on the other path: the host's cost of each, ``autotune.execute.hostfit``)
APPLY_PATHS = ("auto", ApplyPath.DTENSOR.value)


def check_apply_path(name: str) -> None:
    if name not in APPLY_PATHS:
        raise OptionError("apply-path", f"{name!r}: use one of {', '.join(APPLY_PATHS)}")


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


def plan_graph(plan: dict, layers: int | None = None) -> LayerGraph:
    """The model a plan was searched for; ``layers`` runs a shorter (or longer) stack of its tied layers."""
    cfg = dict(plan.get("model") or {})
    kind = model_kind(cfg)
    if kind not in KINDS:
        raise UserError(f"execute runs plans of {', '.join(KINDS)} models, not {kind}: search a plan for one of those")
    if layers is not None:
        if kind != "gpt":
            raise OptionError("layers", f"applies to gpt plans; this plan is for a {kind} model: drop it")
        if layers < 1:
            raise OptionError("layers", "must be at least 1")
    return model_graph(cfg, layers)


def layer_specs(plan: dict, graph: LayerGraph, cluster: Cluster) -> list[LayerSpec]:
    """Each layer's placements as the typed plan reads them, with the boxings inside it (its strategy's)."""
    typed = convert(plan)
    names = [lay.name for lay in typed.layers]
    want = [layer.name for layer in graph.layers]
    if names != want:
        raise UserError(f"the plan's layers {names[:4]}... are not the model's {want[:4]}...: "
                        f"give the plan.json searched for this model")
    out = []
    for layer, lp in zip(graph.layers, typed.layers):
        mesh = RoleMesh(lp.roles)
        strat = strategy(layer, lp.signature, mesh, cluster, graph.act_bytes)
        internal = tuple(Internal(it.tensor, it.shape, _fine_roles(it.src, mesh, cluster), _fine_roles(it.dst, mesh, cluster))
                         for it in strat.internal if it.direction == "fwd")
        out.append(LayerSpec(
            layer, lp.signature, lp.input, lp.output, tuple((w.name, w.shape, w.placements) for w in lp.weights),
            internal, strat.input.shape if strat.input else None, strat.output.shape if strat.output else None,
            _fine_roles(strat.grad_in, mesh, cluster) if strat.grad_in else None))
    return out


def _fine_roles(roles: tuple[str, ...], mesh: RoleMesh, cluster: Cluster) -> tuple[str, ...]:
    return NdSbp(roles, mesh).fine(cluster) or ("B",)
