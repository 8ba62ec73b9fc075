"""Report section for SBP plans (plan.json from ``python -m autotune``)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from reports.html import Section


def _totals(plans: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "strategy": p["strategy"],
        "redistribution s/step": p["totals"]["redistribution_s"],
        "grad sync s/step": p["totals"]["grad_sync_s"],
        "total s/step": p["totals"]["total_s"],
        "memory GiB/device": p["totals"]["memory_bytes"] / 2**30,
    } for p in plans])


def _layers(plan: dict) -> pd.DataFrame:
    return pd.DataFrame([{
        "layer": l["name"], "kind": l["kind"], "x": l["count"], "signature": l["signature"],
        "input": l["sbp"].get("input", "-"), "output": l["sbp"].get("output", "-"),
        "weights": "; ".join(f"{k} {v}" for k, v in l["sbp"]["weights"].items()) or "-",
        "redistribution s": l["redistribution_s"] * l["count"], "grad sync s": l["grad_sync_s"] * l["count"],
        "memory GiB": l["memory_bytes"] * l["count"] / 2**30,
    } for l in plan["layers"]])


def _edges(plan: dict) -> pd.DataFrame:
    return pd.DataFrame([{
        "from": e["from"], "to": e["to"], "x": e["count"],
        "collectives": ", ".join(f"{c['direction']} {c['collective']}/{c['ranks']}({c['tier']})" for c in e["collectives"]) or "none",
        "seconds": e["redistribution_s"] * e["count"],
    } for e in plan["edges"]])


def _breakdown_fig(df: pd.DataFrame):
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(df)))
    y = range(len(df))
    ax.barh(y, df["redistribution s/step"], label="redistribution")
    ax.barh(y, df["grad sync s/step"], left=df["redistribution s/step"], label="gradient sync")
    ax.set_yticks(list(y), df["strategy"])
    ax.invert_yaxis()
    ax.set_xlabel("predicted communication, s per training step")
    ax.legend(loc="lower right")
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


def build(paths: list[Path]) -> list[Section]:
    from autotune.sbp.plan import PlanFile
    sections = []
    for path in paths:
        pf = PlanFile.load(path)
        best = pf.best
        plans = [best] + pf.baselines
        cl = best["cluster"]
        sec = Section(f"SBP plan: {best['model']['name']} on "
                      f"{cl['nodes']} x {cl['gpus_per_node']} GPUs")
        sec.text(f"Profile {best['profile']}; {best['micro_batches']} micro-batches per step; search "
                 f"{best['search'].get('algorithm', '')} stopped by: {best['search'].get('stopped', '')}. "
                 f"Costs are the profile's predictions of communication time per training step.")
        totals = _totals(plans)
        sec.heading("Baselines compared").table(totals)
        sec.figure(_breakdown_fig(totals), "Cost breakdown: redistribution (boxing between and inside layers, "
                                           "forward and backward) and weight-gradient synchronisation.")
        sec.heading("Per-layer plan").table(_layers(best), "x: how often the layer repeats (tied SBP).")
        sec.heading("Redistribution between layers").table(_edges(best))
        if pf.traces:
            opt = min(min((x[1] for x in t), default=float("inf")) for t in pf.traces.values())
            sec.heading("Search convergence")
            sec.figure(_convergence_fig(pf.traces, opt), "Best cost found against search time (cf. AutoDDL Fig. 8).")
        sections.append(sec)
    return sections
