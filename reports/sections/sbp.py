"""Report section for SBP plans (plan.json from ``python -m autotune``)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from calibrate.jsonfile import read_json
from calibrate.schema import AMOUNT, MAYBE_REAL, check
from reports.html import Section
from reports.sections import pipeline as pipeline_section


# what the chart stacks, by the objective the headline compares: its two parts and their sum
PARTS = {"comm": (("redistribution", "redistribution_s"), ("gradient sync", "grad_sync_s"),
                  "predicted communication, s per training step"),
         "step": (("compute", "compute_s"), ("exposed communication", "exposed_comm_s"),
                  "predicted step time, s")}


def _objective(plans: list, objective: str) -> str:
    """The objective whose parts every (strategy, Costs) has (the step's only where each has compute figures)."""
    (_, a), (_, b), _ = PARTS["step"]
    if objective == "step" and all(getattr(c, a) is not None and getattr(c, b) is not None for _, c in plans):
        return "step"
    return "comm"


def _totals(plans: list) -> pd.DataFrame:
    """One row per (strategy, autotune.plan.Costs)."""
    rows = []
    for strategy, t in plans:
        rows.append({
            "strategy": strategy,
            "redistribution s/step": t.redistribution_s,
            "grad sync s/step": t.grad_sync_s,
            "total s/step": t.total_s if t.fits_memory else f"no plan fits (needs {t.memory_bytes / 2**30:.4g} GiB)",
        })
        if t.step_s is not None:
            rows[-1]["step s"] = t.step_s if t.fits_memory else "over memory"
        rows[-1]["memory GiB/device"] = t.memory_bytes / 2**30
    return pd.DataFrame(rows)


def _placements(fine) -> str:
    if fine is None:
        return "-"
    from autotune.plan import dtensor_placement
    return "[" + ", ".join(dtensor_placement(p) for p in fine) + "]"


def _layers(typed) -> pd.DataFrame:
    """The plan's layers (autotune.plan.Plan)."""
    rows = []
    for lay in typed.layers:
        c = lay.costs
        rows.append({
            "layer": lay.name, "kind": lay.kind, "x": lay.count, "signature": lay.signature,
            "input": _placements(lay.input), "output": _placements(lay.output),
            "weights": "; ".join(f"{w.name} {_placements(w.placements)}" for w in lay.weights) or "-",
            "redistribution s": c.get("redistribution_s", 0.0) * lay.count,
            "grad sync s": c.get("grad_sync_s", 0.0) * lay.count,
            "memory GiB": c.get("memory_bytes", 0.0) * lay.count / 2**30,
        })
    return pd.DataFrame(rows)


def _edges(plan) -> pd.DataFrame:
    return pd.DataFrame([{
        "from": e.source, "to": e.target, "x": e.count,
        "collectives": ", ".join(f"{c.direction} {c.collective}/{c.ranks}({c.tier})" for c in e.collectives) or "none",
        "seconds": e.costs["redistribution_s"] * e.count,
    } for p in [s.plan for s in plan.stages] or [plan] for e in p.edges])


def _breakdown_fig(plans: list, objective: str = "comm"):
    """Stacked bars of the two parts of what the headline compares (``objective``: redistribution and
    gradient sync, or compute and exposed communication) per (strategy, Costs), on a log axis when the costs
    span more than 5x (one baseline 10x the others no longer flattens the rest); each bar labelled with its
    total, and plans over the memory limit hatched and labelled so."""
    (first, first_key), (second, second_key), xlabel = PARTS[objective]
    names = [name for name, _ in plans]
    red = [getattr(c, first_key) for _, c in plans]
    sync = [getattr(c, second_key) for _, c in plans]
    tot = [r + g for r, g in zip(red, sync)]
    fits = [c.fits_memory for _, c in plans]
    fig, ax = plt.subplots(figsize=(7.5, 0.6 + 0.45 * len(plans)))
    y = list(range(len(plans)))
    positive = [t for t in tot if t > 0]
    log = len(positive) > 1 and max(positive) > 5 * min(positive)
    hatch = ["" if f else "//" for f in fits]
    if log:  # stacked segments on a log axis: the sync part drawn from the redistribution's end
        low = min(positive) / 3
        ax.barh(y, [max(r, low) - low for r in red], left=low, label=first, hatch=hatch)
        ax.barh(y, [t - max(r, low) if t > max(r, low) else 0 for r, t in zip(red, tot)],
                left=[max(r, low) for r in red], label=second, hatch=hatch)
        ax.set_xscale("log")
        ax.set_xlim(low, max(tot) * 4)
    else:
        ax.barh(y, red, label=first, hatch=hatch)
        ax.barh(y, sync, left=red, label=second, hatch=hatch)
        ax.set_xlim(0, max(tot + [1e-12]) * 1.35)
    for i, (t, f) in enumerate(zip(tot, fits)):
        ax.text(t * (1.08 if log else 1) + (0 if log else max(tot) * 0.01), i,
                f"{t:.3g} s" + ("" if f else " (over memory)"), va="center", fontsize=8)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel + (" (log scale)" if log else ""))
    ax.legend(loc="lower right", fontsize=8)
    return fig


def _convergence_fig(traces: dict, optimum: float):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, trace in traces.items():
        if not trace:
            continue
        t = [max(x[0], 1e-5) for x in trace]
        c = [x[1] / optimum for x in trace]
        ax.step(t + [max(t[-1], 1e-5)], c + [c[-1]], where="post", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("search time, s")
    ax.set_ylabel("best cost / best found")
    ax.legend()
    return fig


def build(paths: list[Path], shown: list[Path] | None = None) -> list[Section]:
    """The sections of the plan files ``paths``, each named on the page as ``shown`` names it (default: its
    path; the search builds its report from a staged copy of the plan it is about to write)."""
    from autotune.export import next_steps
    from autotune.plan.file import PlanFile, plan_title, summary_lines
    sections = []
    for read, path in zip(paths, shown or paths):
        pf = PlanFile.load(read)
        best = pf.best
        per_stage = [(f"stage {i}: ", s.plan) for i, s in enumerate(best.stages)] or [("", best)]
        plans = [(p.strategy, p.costs) for p in [best, *pf.baselines]]
        fsdp = f"over the fine axes {list(best.sharding_axes)}" if best.sharding_mode == "fsdp" else "none"
        objective = _objective(plans, pf.meta.get("objective", "comm"))
        # one plan: the page's title names it (python -m autotune); several: each section does
        sec = Section("Plan and baselines" if len(paths) == 1 else plan_title(best))
        for line in summary_lines(best, pf.baselines, pf.meta.get("objective", "comm")):
            sec.text(line.strip())
        sec.text(f"Profile {best.profile}; {best.micro_batches} micro-batches per step; recomputation "
                 f"{best.recompute}" + (f" (the first {best.recompute_blocks} blocks)" if best.recompute_blocks else "")
                 + f"; FSDP {fsdp}; search "
                 f"{best.search.get('algorithm', '')} stopped by: {best.search.get('stopped', '')}. "
                 + ("Costs are the profile's predictions of the step time: compute and the communication it does "
                    "not hide." if objective == "step" else
                    "Costs are the profile's predictions of communication time per training step."))
        if pf.meta.get("tune"):
            _measured(sec, pf.meta["tune"])
        totals = _totals(plans)
        sec.heading("Baselines compared").table(totals)
        sec.figure(_breakdown_fig(plans, objective),
                   "Cost breakdown: compute and the communication it does not hide; hatched: over the memory limit."
                   if objective == "step" else
                   "Cost breakdown: redistribution (boxing between and inside layers, forward and backward) and "
                   "weight-gradient synchronisation; hatched: over the memory limit.")
        if best.stages:
            pipeline_section.add(sec, best)
        for label, layers in per_stage:
            sec.heading(f"{label}Per-layer plan").table(
                _layers(layers), f"x: how often the layer repeats (tied SBP). Placements per dimension of the "
                                       f"fine DeviceMesh {'x'.join(map(str, layers.mesh.sizes))} "
                                       f"({', '.join(layers.mesh.names)}; node axes first), as PyTorch DTensor writes "
                                       f"them.")
        sec.heading("Redistribution between layers").table(_edges(best))
        sec.heading("Next steps")
        for line in next_steps(path, best)[1:]:
            sec.text(line.strip())
        if pf.traces:
            opt = min(min((x[1] for x in t), default=float("inf")) for t in pf.traces.values())
            sec.heading("Search convergence")
            sec.figure(_convergence_fig(pf.traces, opt), "Best cost found against search time (cf. AutoDDL Fig. 8).")
        sections.append(sec)
    return sections


def _measured(sec: Section, tune: dict) -> None:
    """``autotune tune``'s candidates, predicted beside measured (``meta.tune``), as tune.md has them."""
    from autotune.execute.tune import tune_notes, tune_rows
    rows = tune.get("candidates", [])
    chosen = next((r for r in rows if r.get("strategy") == tune.get("returned")), None)
    sec.heading("Measured by autotune tune")
    sec.text(f"Each candidate run for {tune.get('steps')} steps ({tune.get('warmup')} left out of the median) on "
             f"{tune.get('world')} processes, on {tune.get('module')}; returned: the measured fastest"
             + (f" ({tune['interrupted']}: of those run)." if tune.get("interrupted") else "."))
    sec.table(pd.DataFrame(tune_rows(rows, chosen)), " ".join(tune_notes(rows)))


REPRODUCTION_FIX = "write one with python -m autotune reproduce autoddl --out DIR"
_SCALED = {"alpha_scale": AMOUNT, "beta_scale": AMOUNT, "reduction_pct": MAYBE_REAL, "status": str}
# the rows of the reproduction record as the table reads them
REPRODUCTION_SCHEMA = {"rows": [{
    "id": str, "section": str, "status": str, "paper": {"reduction_pct?": MAYBE_REAL},
    "reduction_pct?": MAYBE_REAL, "reduction_vs_best_pct?": MAYBE_REAL, "difference_pp?": MAYBE_REAL,
    "without_p0_cap?": {"reduction_pct": MAYBE_REAL, "status": str}, "sensitivity?": [_SCALED]}]}


def build_reproduction(paths: list[Path]) -> list[Section]:
    """``python -m autotune reproduce autoddl``'s record: the paper's figure beside ours, per case."""
    from autotune.reproduce import table
    sections = []
    for path in paths:
        rows = read_json(path, "reproduction record", REPRODUCTION_FIX)
        check(rows, REPRODUCTION_SCHEMA, repr(str(path)), REPRODUCTION_FIX)
        rows = rows["rows"]
        passed = sum(r["status"] == "pass" for r in rows)
        sec = Section("AutoDDL's evaluation reproduced")
        sec.text(f"{passed} of {len(rows)} cases pass: the same winner as the paper and a communication reduction "
                 f"within 10 percentage points of the paper's (against the best baseline that fits; the paper's "
                 f"settings, objective: communication per step). Failing cases are explained, with the computation, "
                 f"in reports/records/sbp_reproduce.md.")
        sec.table(pd.DataFrame(table(rows)))
        sections.append(sec)
    return sections
