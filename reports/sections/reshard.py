"""Report section for cross-mesh resharding results (``python -m autotune reshard
--all-cases --pipeline ... --results FILE``, with ``--execute`` the plans run and checked):
the nine cases x strategies (the paper's Fig. 6), a Gantt chart of the chosen
schedule, pipeline timelines (the paper's Fig. 4) and GPU measured vs predicted."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from kernels.reshard.plan import Plan
from kernels.reshard.results import ReshardResults
from reports.html import Section

BASELINE = "greedy_in_order"


def _load(paths: list[Path]) -> list[ReshardResults]:
    return [ReshardResults.load(p) for p in paths]


def _cases_table(cases: list[dict]) -> pd.DataFrame:
    rows = []
    for c in cases:
        t = c["times"]
        chosen = c["chosen"]["makespan"]
        row = {"case": c["case"], "src": f"{c['task']['src_spec']} {tuple(c['task']['src_mesh']['shape'])}",
               "dst": f"{c['task']['dst_spec']} {tuple(c['task']['dst_mesh']['shape'])}",
               "unit tasks": c["unit_tasks"]}
        for st in ("send_recv", "local_allgather", "global_allgather"):
            row[f"{st} (s)"] = t[st][BASELINE]
        row["broadcast naive (s)"] = t["broadcast"]["naive"]
        row["chosen (s)"] = chosen
        row["lower bound (s)"] = c["lower_bound"]
        row["chosen / bound"] = chosen / c["lower_bound"]
        row["x vs send_recv"] = t["send_recv"][BASELINE] / chosen
        row["x vs Alpa"] = t["global_allgather"][BASELINE] / chosen
        row["paper x vs all-gather"] = c.get("paper_speedup_vs_allgather", float("nan"))
        rows.append(row)
    return pd.DataFrame(rows)


def _fig6(cases: list[dict]):
    series = [("send_recv", BASELINE, "Send/Recv"), ("local_allgather", BASELINE, "local all-gather"),
              ("global_allgather", BASELINE, "Alpa (all-gather over the receivers)"),
              ("broadcast", "naive", "broadcast, naive"),
              ("broadcast", "ensemble", "broadcast + ensemble (ours)")]
    x = np.arange(len(cases))
    w = 0.8 / (len(series) + 1)
    fig, ax = plt.subplots(figsize=(11, 3.8))
    for i, (st, so, label) in enumerate(series):
        ax.bar(x + i * w, [c["times"][st][so] for c in cases], w, label=label)
    ax.bar(x + len(series) * w, [c["lower_bound"] for c in cases], w, label="lower bound", color="k", alpha=0.4)
    ax.set_xticks(x + 0.4 - w / 2, [c["case"] for c in cases])
    ax.set_ylabel("predicted time (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _gantt(plan: Plan, title: str):
    lanes = sorted({("send", d // plan.task.devices_per_host) for j in plan.jobs for d in [j.sender]} |
                   {("recv", r // plan.task.devices_per_host) for j in plan.jobs for r in j.receivers})
    index = {lane: i for i, lane in enumerate(lanes)}
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(lanes) + 1.2))
    dph = plan.task.devices_per_host
    for j in plan.jobs:
        hosts = [("send", j.sender // dph)] + [("recv", h) for h in sorted({r // dph for r in j.receivers})]
        for lane in hosts:
            ax.barh(index[lane], j.duration, left=j.start, color=cmap(j.task % 20), edgecolor="k", linewidth=0.3)
        if j.duration > 0.04 * plan.makespan:
            ax.text(j.start + j.duration / 2, index[hosts[0]], str(j.task), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(lanes)), [f"host {h} {k}" for k, h in lanes])
    ax.axvline(plan.lower_bound, color="r", ls="--", lw=1, label="lower bound")
    ax.set_xlabel("time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _timeline(pipe: dict):
    scheds = list(pipe["schedules"])
    fig, axes = plt.subplots(len(scheds), 1, figsize=(12, 1.3 * len(scheds) * 2), squeeze=False)
    colors = {"F": "tab:blue", "B": "tab:orange", "C": "tab:green"}
    for ax, name in zip(axes[:, 0], scheds):
        res = pipe["schedules"][name]
        lanes = sorted({i["lane"] for i in res["intervals"]}, key=lambda s: (not s.startswith("stage"), s))
        for i in res["intervals"]:
            y = lanes.index(i["lane"])
            ax.barh(y, i["end"] - i["start"], left=i["start"], color=colors[i["kind"]], edgecolor="k", linewidth=0.2)
            if i["end"] - i["start"] > 0.012 * res["makespan"]:
                ax.text((i["start"] + i["end"]) / 2, y, str(i["micro_batch"]), ha="center", va="center", fontsize=5)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {res['makespan']:.3f} s, {res['hidden']:.0%} of communication hidden", fontsize=9)
    axes[-1, 0].set_xlabel("time (s); blue forward, orange backward, green inter-stage communication")
    fig.tight_layout()
    return fig


def build(paths: list[Path]) -> list[Section]:
    results = _load(paths)
    sections = []
    cases = [c for r in results for c in r.cases]
    if cases:
        sec = Section("Cross-mesh resharding: strategies and schedules")
        profiles = sorted({r.profile for r in results if r.cases})
        sec.text(f"Predicted times on profile(s) {', '.join(profiles)} under the host-level network model "
                 f"(full duplex, NIC shared by the devices of a host). Baselines balance load greedily, as in the "
                 f"paper; 'chosen' is broadcast-based resharding scheduled by the ensemble of DFS and randomized "
                 f"greedy. The paper's factors are measured on its cluster; ours are simulated.")
        sec.table(_cases_table(cases), "Cases x strategies (the paper's Fig. 6), seconds and speedups.")
        sec.figure(_fig6(cases), "Predicted time per case and strategy (log scale).")
        worst = max(cases, key=lambda c: c["unit_tasks"])
        plan = Plan.from_dict(worst["chosen"])
        sec.figure(_gantt(plan, f"{worst['case']}: chosen schedule, {len(plan.jobs)} jobs, "
                                f"{plan.makespan:.3f} s vs bound {plan.lower_bound:.3f} s"),
                   "Gantt chart of the chosen schedule per host port (numbers: unit task).")
        sections.append(sec)
    for r in results:
        for pipe in r.pipelines:
            sec = Section(f"Pipeline schedules: {pipe['name']}")
            rows = [{"schedule": k, "iteration (s)": v["makespan"], "micro-batches/s": v["throughput"],
                     "communication hidden": v["hidden"],
                     "hidden, steady phase": v.get("hidden_by_phase", {}).get("steady"), "exposed (s)": v["exposed"],
                     "peak activations per stage": str(v["peak_activations"])} for k, v in pipe["schedules"].items()]
            sec.table(pd.DataFrame(rows), "GPipe, 1F1B and eager-1F1B with inter-stage communication overlapped; "
                                          "1f1b_blocking: 1F1B with blocking send/recv as Alpa runs it (the "
                                          "paper's 'Broadcast' baseline).")
            sec.figure(_timeline(pipe), "Timelines per stage and link (the paper's Fig. 4).")
            sections.append(sec)
    gpu = [dict(g, profile=r.profile) for r in results for g in r.executed]
    if gpu:
        sec = Section("Cross-mesh resharding executed and checked (measured against predicted)")
        df = pd.DataFrame(gpu)
        df["measured / predicted"] = df["measured_s"] / df["predicted_s"].where(df["predicted_s"] > 0)
        sec.table(df, "Every destination tile checked exactly ('wrong' counts bad elements).")
        sections.append(sec)
    return sections
