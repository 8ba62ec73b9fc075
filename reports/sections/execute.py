"""Report section for executed plans (``python -m autotune execute --summarize DIR``'s
summary.json): predicted against measured step time, communication time and
memory per plan, with the Spearman rank correlation and the targets of issue 15, and the
first plan's layer clock (each layer's predicted and measured forward and backward)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from autotune.execute.result import format_targets, load_summary
from reports.html import Section


def ms(x):
    return float("nan") if x is None else x * 1e3


def _table(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "plan": r["strategy"], "predicted step ms": ms(r["pred_step_s"]), "measured step ms": ms(r["step_s"]),
        "predicted comm ms": ms(r["pred_comm_s"]),
        # the measurement the verdict compares (the collectives replayed alone), beside the training step's own
        "replayed comm ms (verdict)": ms(r.get("comm_alone_s")), "in-step kernel comm ms": ms(r["comm_s"]),
        "predicted GiB": (r["pred_memory_bytes"] or float("nan")) / 2**30,
        "measured GiB": (r["memory_bytes"] or float("nan")) / 2**30,
        "loss first": r["loss_first"], "loss last": r["loss_last"],
    } for r in rows])


def _layers(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{
        "layer": r["layer"], "kind": r["kind"], "positions": r["positions"],
        "predicted forward ms": ms(r["pred_fwd_s"]), "measured forward ms": ms(r["fwd_s"]),
        "predicted backward ms": ms(r["pred_bwd_s"]), "measured backward ms": ms(r["bwd_s"]),
    } for r in rows])


def _scatter(rows: list[dict], pred: str, meas: str, what: str):
    pts = [(r[pred] * 1e3, r[meas] * 1e3, r["strategy"]) for r in rows
           if r.get(pred) is not None and r.get(meas) is not None]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts])
    for x, y, name in pts:  # whole names, wrapped (two plans may differ only at their end)
        ax.annotate(textwrap.fill(name, 32), (x, y), fontsize=6)
    hi = max(max(p[0], p[1]) for p in pts) * 1.05
    ax.plot([0, hi], [0, hi], lw=0.8, color="grey")
    ax.set_xlabel(f"predicted {what} (ms)")
    ax.set_ylabel(f"measured {what} (ms)")
    return fig


def build(paths: list[Path]) -> list[Section]:
    out = []
    for p in paths:
        s = load_summary(p)
        c = s["cluster"]
        sec = Section(f"Executed plans: {s['model'].get('name', '')} on {c['nodes']} x {c['gpus_per_node']} "
                      f"{s['device']} ({s['backend']}, {s['dtype']})")
        sec.text("Each plan's training step run for real (python -m autotune execute): measured step time, time in "
                 "collectives and peak memory per device beside the plan's predictions. Communication: the verdict "
                 "compares the prediction with the plan's collectives replayed alone (same calls, sizes and groups, "
                 "no compute); the in-step kernel time (profiler) is shown beside it.")
        sec.table(_table(s["rows"]), "predicted against measured, per plan")
        for pred, meas, what in (("pred_step_s", "step_s", "step time"),
                                 ("pred_comm_s", "comm_alone_s", "communication (replayed)")):
            fig = _scatter(s["rows"], pred, meas, what)
            if fig is not None:
                sec.figure(fig, f"{what}: measured against predicted (the line: equal)")
        for line in format_targets(s["targets"]).splitlines():
            sec.text(line)
        for plan, rows in list((s.get("layers") or {}).items())[:1]:
            sec.table(_layers(rows), f"{plan}, layer by layer (ms per step; forward and backward include the "
                                     "boxing into the layer; the optimizer in the forward columns)")
        out.append(sec)
    return out
