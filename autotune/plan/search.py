"""Today's plan dict (``plan["best"]`` of ``python -m autotune``'s plan.json) as a typed plan: the model
rebuilt from its fields for the layers' dims, each layer's SBP notation expanded to fine-axis placements,
its weights' shapes from its strategy."""
from __future__ import annotations

from calibrate.errors import UserError
from calibrate.records import check_header, kind_of
from models.builders import BUILDERS
from models.graph import Layer, LayerGraph
from models.loader import FIELDS, OPTIONAL, validate

from autotune.plan.typed import (SEARCH_KIND, Baseline, Costs, FineMesh, LayerPlan, ModelSpec, TypedPlan, WeightPlan,
                                 read_source)
from autotune.sbp.layers import MATMUL_ORDERS, SUMMAS, Matmul, make_op
from autotune.sbp.mesh import Cluster, RoleMesh
from autotune.sbp.sbp import NdSbp, parse

LAYER_COSTS = ("redistribution_s", "grad_sync_s", "memory_bytes", "compute_s", "forward_s", "backward_s",
               "optimizer_s")


def model_kind(cfg: dict) -> str:
    if cfg.get("kind") in BUILDERS:
        return cfg["kind"]
    for kind, fields in FIELDS.items():
        if set(fields) - OPTIONAL <= set(cfg):
            return kind
    raise UserError("the plan's model section names no known model: re-run the search (python -m autotune --out DIR)")


# a gpt plan written before the transformer family (no "residual" field) was searched on the AutoDDL graph
LEGACY_GPT = {"residual": False, "attention": "naive", "tied": False, "bias": False, "positions": "none"}


def model_graph(cfg: dict, layers: int | None = None) -> LayerGraph:
    """The layer graph of a plan's model section; ``layers`` overrides its number of blocks."""
    kind = model_kind(cfg)
    cfg = {k: v for k, v in cfg.items() if k in FIELDS[kind] or k in ("name", "source", "description")}
    if kind == "gpt" and "residual" not in cfg:
        cfg = {**cfg, **LEGACY_GPT}
    if layers is not None:
        cfg["layers"] = layers
    return BUILDERS[kind](validate(kind, cfg, "the plan's model"))


def fine(text: str, cluster: Cluster, where: str) -> tuple[str, ...]:
    """Fine-axis placements of the plan's notation ``(S0: (2, 1), B: (1, 2))``."""
    try:
        out = parse(text, cluster).fine(cluster)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    return out if out else ("B",)  # one device: a single axis of size 1


def strategy(layer: Layer, signature: str, mesh: RoleMesh, cluster: Cluster, act_bytes: int):
    """The strategy of ``layer`` a plan names by signature and role mesh."""
    return Strategies()(layer, signature, mesh, cluster, act_bytes)


class Strategies:
    """``strategy`` for many plans on one cluster (a pipelined plan's stages): a layer's strategies are
    enumerated once per (layer, cluster), not once per plan that names one of them."""

    def __init__(self):
        self._found: dict = {}

    def __call__(self, layer: Layer, signature: str, mesh: RoleMesh, cluster: Cluster, act_bytes: int):
        op = make_op(layer, act_bytes)
        if isinstance(op, Matmul):
            if signature not in MATMUL_ORDERS and signature not in SUMMAS:
                raise UserError(f"layer {layer.name}: signature {signature!r} is not a strategy of a {layer.kind} "
                                f"layer (those are {', '.join([*MATMUL_ORDERS, *SUMMAS])}): re-run the search")
            return op.build(signature, mesh)
        key = (layer, cluster, act_bytes)
        if key not in self._found:
            self._found[key] = {(s.signature, s.mesh): s for s in reversed(op.strategies(cluster))}
        found = self._found[key].get((signature, mesh))
        if found is None:
            raise UserError(f"layer {layer.name}: signature {signature!r} on mesh {[list(m) for m in mesh.sizes]} is "
                            f"not a strategy of a {layer.kind} layer on {cluster}: re-run the search")
        return found


def _cluster(best: dict, origin: str) -> Cluster:
    try:
        return Cluster(int(best["cluster"]["nodes"]), int(best["cluster"]["gpus_per_node"]))
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{origin}: no cluster nodes/gpus_per_node: re-run python -m autotune --out DIR") from None


def _stage_layers(graph: LayerGraph, names: list) -> list[Layer]:
    """The model's layers a pipeline stage's plan names: a non-empty run of them in the model's order."""
    it = iter(graph.layers)
    picked = [next((layer for layer in it if layer.name == name), None) for name in names]
    return picked if names and all(picked) else []


def refuse_pipelined(best: dict, origin: str) -> None:
    """A pipelined plan (its stages' plans inside) is placed stage by stage: read as one plan, its layers
    would not be its model's, so it is pointed to ``autotune.apply_pipeline`` instead."""
    if isinstance(best, dict) and "stages" in best:
        n = len(best["stages"]) if isinstance(best["stages"], list) else "several"
        raise UserError(f"{origin}: the plan is pipelined ({n} stages), and autotune.apply places a plan of one "
                        f"stage: place it with autotune.apply_pipeline(plan, model) (or search with --pipeline off)")


def convert(best: dict, baselines=(), origin: str = "plan", stage: bool = False,
            strategies: Strategies | None = None) -> TypedPlan:
    """``stage``: ``best`` is one stage's plan of a pipelined plan (``plan["best"]["stages"][i]["plan"]``),
    whose layers are those of the model that the stage runs, in the model's order; ``strategies``: a lookup
    shared by the plans converted together (``convert_stages``)."""
    if not stage:
        refuse_pipelined(best, origin)
    strategies = strategies or Strategies()
    cfg = dict(best.get("model") or {})
    graph = model_graph(cfg)
    cluster = _cluster(best, origin)
    entries = best.get("layers") or []
    names = [e.get("name") for e in entries]
    want = [layer.name for layer in graph.layers]
    model_layers = _stage_layers(graph, names) if stage else graph.layers if names == want else []
    if not model_layers:
        raise UserError(f"{origin}: the plan's layers {names[:4]}... are not {'a run of ' if stage else ''}its "
                        f"model's {want[:4]}...: re-run the search for this model")
    layers = []
    for layer, e in zip(model_layers, entries):
        where = f"{origin}: layer {layer.name}"
        try:
            mesh = RoleMesh(tuple(tuple(m) for m in e["mesh"]))
            sbp, sig = e["sbp"], e["signature"]
        except (KeyError, TypeError):
            raise UserError(f"{where} lacks mesh, sbp or signature: re-run the search") from None
        shapes = {w.name: w.shape for w in strategies(layer, sig, mesh, cluster, graph.act_bytes).weights}
        weights = []
        for name, text in sbp.get("weights", {}).items():
            if name not in shapes:
                raise UserError(f"{where}: the plan places a weight {name!r} that a {layer.kind} layer has not: "
                                f"re-run the search")
            weights.append(WeightPlan(name, tuple(shapes[name]), fine(text, cluster, where)))
        layers.append(LayerPlan(
            layer.name, layer.kind, int(e.get("count", 1)), layer.all_dims(), sig,
            fine(sbp["input"], cluster, where) if "input" in sbp else None,
            fine(sbp["output"], cluster, where) if "output" in sbp else None,
            tuple(weights), {k: e[k] for k in LAYER_COSTS if k in e}, mesh.sizes))
    sharding = best.get("sharding") or {"mode": "none", "axes": []}
    return TypedPlan(
        ModelSpec(graph.model, {k: v for k, v in cfg.items() if k != "kind"}), cluster, FineMesh.of(cluster),
        tuple(layers), int(best.get("micro_batches", 1)), best.get("recompute", "none"),
        sharding.get("mode", "none"), tuple(sharding.get("axes", ())), best.get("strategy", ""),
        best.get("profile", ""), Costs.from_dict(best["totals"], f"{origin}: totals") if "totals" in best else None,
        tuple(Baseline(b.get("strategy", ""), Costs.from_dict(b["totals"], f"{origin}: baseline totals"))
              for b in baselines))


def from_problem(problem, assign, strategy: str = "") -> TypedPlan:
    """The typed plan of ``assign`` on ``problem`` (an ``autotune.sbp.cost.Problem``) as the search holds it:
    each layer's placements read from its chosen strategy, not re-enumerated and without the costs (what
    apply's path needs: ``autotune.pipeline.paths``). Its layers are ``convert(build_plan(problem, assign))``'s."""
    cl = problem.cluster

    def fine_of(t, s):
        return None if t is None else NdSbp(t.sbp, s.mesh).fine(cl) or ("B",)  # one device: one axis of size 1
    layers = []
    for op, s_i, count, choices in zip(problem.ops, assign, problem.counts, problem.choices):
        s = choices[s_i]
        layers.append(LayerPlan(op.layer.name, op.layer.kind, count, op.layer.all_dims(), s.signature,
                                fine_of(s.input, s), fine_of(s.output, s),
                                tuple(WeightPlan(w.name, tuple(w.shape), fine_of(w, s)) for w in s.weights),
                                {}, s.mesh.sizes))
    sharding = problem.mode.sharding
    config = {k: v for k, v in {"name": problem.graph.model, **problem.graph.config}.items() if k != "kind"}
    return TypedPlan(ModelSpec(problem.graph.model, config), cl,
                     FineMesh.of(cl), tuple(layers), problem.mb, problem.mode.recompute, sharding["mode"],
                     tuple(sharding["axes"]), strategy, problem.coster.profile.name)


def convert_stages(best: dict, origin: str = "plan") -> list[TypedPlan]:
    """Each stage's typed plan of a pipelined ``plan["best"]`` (``convert(..., stage=True)`` per stage), the
    layers' strategies enumerated once for all stages."""
    strategies = Strategies()
    return [convert(s["plan"], (), f"{origin}: stage {s['stage']}", True, strategies) for s in best["stages"]]


def load_plan(source, origin: str | None = None) -> TypedPlan:
    """The one loader: a TypedPlan, a typed-plan file or dict, or the search's plan.json (file or dict,
    converted). An old version of either is one error naming the version and the fix."""
    if isinstance(source, TypedPlan):
        return source
    source, origin = read_source(source, origin, "give a plan written by python -m autotune --out DIR")
    if kind_of(source) == SEARCH_KIND and "best" in source:
        from autotune.sbp.plan import PlanFile
        pf = PlanFile.from_dict(source, origin)
        return convert(pf.best, pf.baselines, origin)
    if kind_of(source) == SEARCH_KIND:  # one plan dict, plan["best"]
        from autotune.sbp.plan import VERSION as SEARCH_VERSION
        check_header(source, SEARCH_KIND, SEARCH_VERSION, "SBP plan", "re-run python -m autotune --out DIR", origin)
        return convert(source, (), origin)
    return TypedPlan.from_dict(source, origin)
