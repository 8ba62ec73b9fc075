"""plan.json: the search's plans (``PlanFile``: the chosen plan, the baselines, the convergence traces, the
run's facts), each a ``Plan`` as its record; ``load_plan`` reads the one a user applies. An older plan.json is
refused in one line naming the fix (re-run the search). ``summary_lines``: the chosen plan against the baselines,
in words."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.records import check_header, header, kind_of

from autotune.plan.typed import FIX, Plan

KIND = "commtune.sbp-plan"
VERSION = 2  # 1: untyped plan dicts (before the search built the Plan)


@dataclass
class PlanFile:
    """plan.json: the chosen plan, the baselines and the convergence traces."""

    best: Plan
    baselines: list[Plan] = field(default_factory=list)
    traces: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**header(KIND, VERSION), "meta": self.meta, "best": self.best.to_dict(),
                "baselines": [b.to_dict() for b in self.baselines], "traces": self.traces}

    @classmethod
    def from_dict(cls, d, origin: str = "plan") -> "PlanFile":
        check_header(d, KIND, VERSION, "plan file", FIX, origin)
        if not isinstance(d.get("baselines", []), list) or not isinstance(d.get("traces", {}), dict) or \
                not isinstance(d.get("meta", {}), dict):
            raise UserError(f"{origin}: baselines is not a list or traces or meta not an object: {FIX}")
        plans = [Plan.from_dict(p, f"{origin}: {w}") for p, w in
                 [(d.get("best"), "best")] + [(b, f"baseline {i}") for i, b in enumerate(d.get("baselines", []))]]
        for p, w in zip(plans, ["best"] + [f"baseline {i}" for i in range(len(plans) - 1)]):
            if p.costs is None:
                raise UserError(f"{origin}: {w} has no costs: {FIX}")
        return cls(plans[0], plans[1:], d.get("traces", {}), d.get("meta", {}))

    def save(self, path: str | Path) -> Path:
        return write_json(Path(path), self.to_dict(), "plan file")

    @classmethod
    def load(cls, path: str | Path) -> "PlanFile":
        d = read_json(path, "plan file", "run python -m autotune --out DIR first")
        return cls.from_dict(d, origin=f"plan file {str(path)!r}")

    def select(self, which: str) -> list[Plan]:
        """best, all, or baseline:NAME (the baselines whose name starts with NAME); a bad ``which`` is one
        ``UserError`` naming the choices."""
        if which in ("best", "all"):
            return [self.best] + (list(self.baselines) if which == "all" else [])
        name = which.split(":", 1)[1].strip().lower() if which.startswith("baseline:") else ""
        hits = [b for b in self.baselines if name and b.strategy.lower().startswith(name)]
        if not hits:
            names = ", ".join(repr(b.strategy) for b in self.baselines)
            raise UserError(f"{which!r} is neither best, all nor baseline:NAME of a baseline in the plan file: use "
                            f"one of best, all, baseline:NAME with NAME one of {names}")
        return hits


def load_plan(source, origin: str | None = None) -> Plan:
    """The one loader: a Plan as it is; plan.json (its path or dict: its best plan) or one plan's dict."""
    if isinstance(source, Plan):
        return source
    if isinstance(source, (str, Path)):
        origin = origin or f"plan file {str(source)!r}"
        source = read_json(source, "plan file", "give a plan written by python -m autotune --out DIR")
    origin = origin or "plan"
    if kind_of(source) is not None:
        return PlanFile.from_dict(source, origin).best
    return Plan.from_dict(source, origin)


def plan_title(best: Plan) -> str:
    cl = best.cluster
    return f"SBP plan: {best.model.kind} {best.model.get('name', '')} on {cl.nodes} x {cl.gpus_per_node} GPUs".replace("  ", " ")


def comparison(best: Plan, baselines: list[Plan], objective: str = "comm") -> dict:
    """The chosen plan against the baselines: the best baseline that fits the memory limit, the predicted
    speed-up over it (its cost / the plan's, in the objective's seconds per step), and the baselines that do
    not fit with the memory each needs."""
    fit = [b for b in baselines if b.costs.fits_memory and b.costs.of(objective) is not None]
    ref = min(fit, key=lambda b: b.costs.of(objective)) if fit else None
    plan_s = best.costs.of(objective)
    return {
        "objective": objective, "plan_s": plan_s, "memory_limit_bytes": best.memory_limit_bytes,
        "best_baseline": ref.strategy if ref else None,
        "baseline_s": ref.costs.of(objective) if ref else None,
        "speedup": ref.costs.of(objective) / plan_s if ref and plan_s > 0 else None,
        "unfit": [{"strategy": b.strategy, "needs_bytes": b.costs.memory_bytes}
                  for b in baselines if not b.costs.fits_memory],
    }


def summary_lines(best: Plan, baselines: list[Plan], objective: str = "comm") -> list[str]:
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
                     f"{best.costs.memory_bytes / 2**30:.4g} GiB")
        for u in c["unfit"]:
            lines.append(f"  {u['strategy']}: no plan fits (needs {u['needs_bytes'] / 2**30:.4g} GiB, "
                         f"{(u['needs_bytes'] - limit) / 2**30:.4g} GiB over)")
    return lines
