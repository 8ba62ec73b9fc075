"""Plans as versioned JSON: per layer its SBP, collectives and costs, and the
same placements as PyTorch DTensor placements.

DTensor export: a layer's role mesh becomes a DeviceMesh with one dimension
per (role, nodes) and (role, GPUs) part larger than one, node parts first, so
that ``torch.arange(world).reshape(mesh_shape)`` lays ranks out as
rank = node * gpus_per_node + gpu. Apply it with::

    mesh = DeviceMesh("cuda", torch.arange(world).reshape(layer["dtensor"]["mesh_shape"]))
    w = distribute_tensor(weight, mesh, [eval(p) for p in layer["dtensor"]["weights"]["weight"]])

(``Shard``, ``Replicate``, ``Partial`` from torch.distributed.tensor). Where several
mesh dimensions shard one tensor dimension, DTensor nests them left to right;
the plan's strided layouts (see autotune.sbp.sbp) are the same up to a static
permutation of blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from calibrate.records import check_header, header
from calibrate.jsonfile import read_json, write_json

from autotune.sbp.modulecal import source as compute_source
from autotune.sbp.boxing import Step, copy_seconds
from autotune.sbp.cost import Problem, edge_steps, internal_steps, memory, sync_steps
from autotune.sbp.layers import Strategy
from autotune.sbp.memory import RERUN
from autotune.sbp.mesh import Cluster
from autotune.sbp.plancheck import check_plan
from autotune.sbp.sbp import B, P, is_split, split_dim
from autotune.sbp.steptime import fsdp_steps, layer_seconds, optimizer_seconds

KIND = "commtune.sbp-plan"
VERSION = 1


def dtensor_placement(p: str) -> str:
    if is_split(p):
        return f"Shard({split_dim(p)})"
    return "Replicate()" if p == B else 'Partial("sum")' if p == P else p


def nd_sbp_placement(p: str) -> str:
    """OneFlow's nd-SBP spelling of one mesh axis: S(0), B, P."""
    return f"S({split_dim(p)})" if is_split(p) else p


def _mesh_dims(s: Strategy) -> list[tuple[int, int, str]]:
    """(size, role, name) of the DeviceMesh dimensions of a layer's mesh: node parts first."""
    dims = []
    for part, label in ((0, "nodes"), (1, "gpus")):
        for r, size in enumerate(s.mesh.sizes):
            if size[part] > 1:
                dims.append((size[part], r, f"r{r}_{label}"))
    return dims


def nd_sbp(s: Strategy) -> dict:
    """The layer's placements per DeviceMesh dimension as nd-SBP, e.g. ``(S(0), B)``."""
    dims = _mesh_dims(s)

    def fmt(t):
        return "(" + ", ".join(nd_sbp_placement(t.sbp[r]) for _, r, _ in dims) + ")"
    out = {k: fmt(t) for k, t in (("input", s.input), ("output", s.output)) if t is not None}
    out["weights"] = {w.name: fmt(w) for w in s.weights}
    return out


def layer_sbp(s: Strategy, cluster: Cluster) -> dict:
    """A strategy's placements as a plan's layer records them (``"sbp"``): input, output and weights."""
    return {**({"input": s.sbp(s.input, cluster)} if s.input else {}),
            **({"output": s.sbp(s.output, cluster)} if s.output else {}),
            "weights": {w.name: s.sbp(w, cluster) for w in s.weights}}


def dtensor(s: Strategy, cluster: Cluster) -> dict:
    dims = _mesh_dims(s)
    out = {"mesh_shape": [d[0] for d in dims], "mesh_dim_names": [d[2] for d in dims]}
    for key, t in (("input", s.input), ("output", s.output)):
        if t is not None:
            out[key] = [dtensor_placement(t.sbp[r]) for _, r, _ in dims]
    out["weights"] = {w.name: [dtensor_placement(w.sbp[r]) for _, r, _ in dims] for w in s.weights}
    return out


def _comm(step: Step, problem: Problem, **extra) -> dict:
    g = problem.cluster.group(step.axes)
    return dict(extra, collective=step.op, axes=list(step.axes), ranks=g.ranks, nodes=g.nodes,
                tier=g.tier, nbytes=step.nbytes, seconds=problem.coster.step_time(step))


def _layer_clock(problem: Problem, op, s: Strategy, role: str, tied: bool) -> dict:
    """One occurrence's predicted forward and backward of one micro-batch (the op, with its own
    boxing and the local copies around it) and optimizer step, as ``autotune execute``'s layer
    clock measures them; the boxing into the layer is its in-edge's ``forward_s``/``backward_s``."""
    cl, cm, ab = problem.cluster, problem.compute, problem.act_bytes
    rec = problem.mode.recompute
    t = dict(zip(("fwd", "bwd"), layer_seconds(op, s, cl, cm, ab, rec, role)))
    for _, direction, steps in internal_steps(s, cl):
        sec = problem.coster.time(steps) + copy_seconds(steps, cm.memory_seconds)
        t[direction] += sec
        if direction == "fwd" and rec == "full" and role in RERUN:
            t["bwd"] += sec
    return {"forward_s": t["fwd"], "backward_s": t["bwd"],
            "optimizer_s": optimizer_seconds(s, cl, cm, ab, problem.mode, tied)}


def build_plan(problem: Problem, assign: list[int], strategy: str, search: dict | None = None) -> dict:
    cl, mb = problem.cluster, problem.mb
    layers, edges = [], []
    red_total = sync_total = comp_total = 0.0
    tied_saved = problem.tied_saved(assign)  # the tied logits' weight gradient synced with the embedding's
    for v, (op, s_i, count) in enumerate(zip(problem.ops, assign, problem.counts)):
        s = problem.choices[v][s_i]
        comms = [_comm(st, problem, phase="internal", tensor=t, direction=d, per="micro-batch")
                 for t, d, steps in internal_steps(s, cl) for st in steps if st.collective]
        comms += [_comm(st, problem, phase="grad-sync", tensor=t, direction="bwd", per="step")
                  for t, st in sync_steps(s, cl, problem.grad_bytes, problem.mode)]
        comms += [_comm(st, problem, phase="fsdp", tensor=t, direction=d, per="micro-batch")
                  for t, d, st in fsdp_steps(s, cl, problem.mode)]
        red = float(problem.node_redist[v][s_i])
        sync = float(problem.node_sync[v][s_i])
        if tied_saved and v == problem.tied_pair[0]:
            sync -= tied_saved
            comms = [c for c in comms if not (c["phase"] == "grad-sync" and c["tensor"] == "weight")]
        comp = float(problem.node_compute[v][s_i]) if problem.node_compute is not None else None
        clock = _layer_clock(problem, op, s, problem.roles[v], problem.tied[v]) if comp is not None else {}
        comp_total += count * (comp or 0.0)
        red_total += count * red
        sync_total += count * sync
        layers.append({
            "name": op.layer.name, "kind": op.layer.kind, "count": count, "signature": s.signature,
            "mesh": [list(x) for x in s.mesh.sizes],
            "sbp": layer_sbp(s, cl),
            "dtensor": dtensor(s, cl), "nd_sbp": nd_sbp(s), "collectives": comms,
            "redistribution_s": red, "grad_sync_s": sync, "memory_bytes": memory(s, cl, problem.act_bytes, problem.mode, problem.roles[v], problem.tied[v]),
            **({"compute_s": comp, "compute_source": compute_source(problem.module_cal, op, s, cl, problem.roles[v])}
               if comp is not None else {}), **clock,
        })
    for (a, b), count in problem.edge_counts.items():
        sa, sb = problem.choices[a][assign[a]], problem.choices[b][assign[b]]
        fwd, bwd = edge_steps(sa, sb, problem.ops[a].out_shape, cl, problem.tables.sizes(a, b))
        comms = [_comm(st, problem, phase="boxing", tensor=problem.ops[a].layer.name, direction=d, per="micro-batch")
                 for d, steps in (("fwd", fwd), ("bwd", bwd)) for st in steps if st.collective]
        rerun = problem.tables.forward_factor.get((a, b), 1.0)  # full recomputation re-runs forward boxings
        t = mb * (rerun * problem.coster.time(fwd) + problem.coster.time(bwd))
        red_total += count * t
        copies = {}
        if problem.compute is not None:  # DTensor's local copies around the steps: compute time
            cf, cb = (copy_seconds(x, problem.compute.memory_seconds) for x in (fwd, bwd))
            copies = {"copy_s": mb * (rerun * cf + cb), "forward_s": problem.coster.time(fwd) + cf,
                      "backward_s": problem.coster.time(bwd) + cb}
            comp_total += count * copies["copy_s"]
        edges.append({"from": problem.ops[a].layer.name, "to": problem.ops[b].layer.name, "count": count,
                      "collectives": comms, "redistribution_s": t, **copies})
    totals = {"redistribution_s": red_total, "grad_sync_s": sync_total,
              "total_s": red_total + sync_total, "memory_bytes": problem.peak_memory(assign),
              "memory": problem.memory_breakdown(assign).to_dict(),
              "fits_memory": problem.fits_plan(assign)}
    if problem.node_compute is not None:  # the step-time model (autotune.sbp.steptime)
        exposed = red_total + problem.exposed_sync(assign)
        totals.update(compute_s=comp_total, exposed_comm_s=exposed, step_s=comp_total + exposed)
    return {
        **header(KIND, VERSION), "strategy": strategy,
        "model": {"name": problem.graph.model, **problem.graph.config, "kind": problem.graph.model},
        "cluster": {"nodes": cl.nodes, "gpus_per_node": cl.gpus_per_node},
        "profile": problem.coster.profile.name, "micro_batches": mb,
        "memory_limit_bytes": problem.device_limit, "search": search or {},
        "recompute": problem.mode.recompute, "sharding": problem.mode.sharding,
        "assignment": [int(a) for a in assign],
        "objective": problem.objective, "totals": totals,
        **({"compute_source": plan_source(layers)} if problem.node_compute is not None else {}),
        "layers": layers, "edges": edges,
    }


@dataclass
class PlanFile:
    """plan.json: the chosen plan, the baselines and the convergence traces."""

    best: dict
    baselines: list[dict] = field(default_factory=list)
    traces: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**header(KIND, VERSION), "meta": self.meta, "best": self.best,
                "baselines": self.baselines, "traces": self.traces}

    @classmethod
    def from_dict(cls, d: dict, origin: str = "plan") -> "PlanFile":
        check_header(d, KIND, VERSION, "SBP plan", "give a plan.json written by python -m autotune, or re-run the "
                     "search", origin)
        check_plan(d, origin)
        return cls(d["best"], d.get("baselines", []), d.get("traces", {}), d.get("meta", {}))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        return write_json(path, self.to_dict(), "plan file")

    @classmethod
    def load(cls, path: str | Path) -> "PlanFile":
        d = read_json(path, "plan file", "run python -m autotune --out DIR first")
        return cls.from_dict(d, origin=f"plan file {str(path)!r}")


def plan_source(layers: list[dict]) -> str:
    """A plan's compute source: "module" where every layer's compute is priced from the user's module as
    measured (``autotune.sbp.modulecal``), "analytical" where none is, else "module+analytical"."""
    found = {layer.get("compute_source", "analytical") for layer in layers}
    return "module+analytical" if len(found) > 1 else found.pop() if found else "analytical"


def plan_title(best: dict) -> str:
    m, cl = best["model"], best["cluster"]
    return f"SBP plan: {m.get('kind', '')} {m['name']} on {cl['nodes']} x {cl['gpus_per_node']} GPUs".replace("  ", " ")


# what each objective minimises: a key of a plan's totals
OBJECTIVES = {"comm": "total_s", "step": "step_s"}


def comparison(best: dict, baselines: list[dict], objective: str = "comm") -> dict:
    """The chosen plan against the baselines: the best baseline that fits the memory limit, the predicted
    speed-up over it (its cost / the plan's, in the objective's seconds per step), and the baselines that do
    not fit with the memory each needs."""
    key = OBJECTIVES[objective]
    fit = [b for b in baselines if b["totals"]["fits_memory"] and key in b["totals"]]
    ref = min(fit, key=lambda b: b["totals"][key]) if fit else None
    plan_s = best["totals"][key]
    return {
        "objective": objective, "key": key, "plan_s": plan_s,
        "memory_limit_bytes": best.get("memory_limit_bytes"),
        "best_baseline": ref["strategy"] if ref else None,
        "baseline_s": ref["totals"][key] if ref else None,
        "speedup": ref["totals"][key] / plan_s if ref and plan_s > 0 else None,
        "unfit": [{"strategy": b["strategy"], "needs_bytes": b["totals"]["memory_bytes"]}
                  for b in baselines if not b["totals"]["fits_memory"]],
    }


def summary_lines(best: dict, baselines: list[dict], objective: str = "comm") -> list[str]:
    """What the user came for, in words: the speed-up, the memory limit, the baselines that do not fit."""
    c = comparison(best, baselines, objective)
    what = "communication" if objective == "comm" else "step time"
    limit = c["memory_limit_bytes"]
    lines = []
    if c["best_baseline"] is None:
        lines.append(f"searched plan: {c['plan_s']:.4g} s/step predicted {what}; no baseline fits the memory limit")
    elif c["speedup"] is None:
        lines.append(f"searched plan: {c['plan_s']:.4g} s/step predicted {what}, as the best baseline that fits, "
                     f"{c['best_baseline']}")
    elif c["speedup"] == 0:
        lines.append(f"searched plan: {c['plan_s']:.4g} s/step predicted {what}; the best baseline that fits, "
                     f"{c['best_baseline']}, predicts none")
    else:
        change = (1 - 1 / c["speedup"]) * 100
        lines.append(f"searched plan: {c['plan_s']:.4g} s/step predicted {what}, {c['speedup']:.2f}x "
                     f"({abs(change):.1f}% {'less' if change >= 0 else 'more'}) against the best baseline that "
                     f"fits, {c['best_baseline']} at {c['baseline_s']:.4g} s/step")
    if limit is not None:
        lines.append(f"memory limit {limit / 2**30:.4g} GiB per device; the searched plan needs "
                     f"{best['totals']['memory_bytes'] / 2**30:.4g} GiB")
        for u in c["unfit"]:
            lines.append(f"  {u['strategy']}: no plan fits (needs {u['needs_bytes'] / 2**30:.4g} GiB, "
                         f"{(u['needs_bytes'] - limit) / 2**30:.4g} GiB over)")
    return lines
