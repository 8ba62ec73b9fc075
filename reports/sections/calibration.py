"""Report section for calibration runs: busbw and latency against size, the
statistics table and the measured peak, per collective and tier."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from calibrate.results import load_results
from reports.html import Section

SMALL = 1 << 20


def _runs(paths: list[Path]) -> pd.DataFrame:
    frames = []
    for (meta, st), path in zip(load_results(paths), paths):
        cfg = meta["config"]
        frames.append(st.assign(run=path.name, backend=cfg["backend"]))
    return pd.concat(frames, ignore_index=True)


def _curve_label(r) -> str:
    return f"{r['run']} {r['group']} ({r['tier']}, {r['backend']}, {r['mode']})"


def _grid(df: pd.DataFrame, colls: list[str], column: str, ylabel: str, suffix: str):
    """One panel per collective, one curve per run, group and mode, against size on a log2 axis.

    Times (``median_s``) are drawn in microseconds with the 95% confidence interval of the median.
    """
    ncol = 3
    nrow = (len(colls) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False)
    for ax, coll in zip(axes.flat, colls):
        for _, g in df[df["collective"] == coll].groupby(["run", "group", "tier", "backend", "mode"]):
            g = g.sort_values("bytes")
            if column == "median_s":
                ax.errorbar(g["bytes"], g["median_s"] * 1e6,
                            yerr=[(g["median_s"] - g["ci_lo_s"]) * 1e6, (g["ci_hi_s"] - g["median_s"]) * 1e6],
                            marker=".", capsize=2, label=_curve_label(g.iloc[0]))
            else:
                ax.plot(g["bytes"], g[column], marker=".", label=_curve_label(g.iloc[0]))
        ax.set_xscale("log", base=2)
        ax.set_title(coll + suffix)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(colls):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def build(paths: list[Path]) -> list[Section]:
    df = _runs(paths)
    sec = Section("Calibration: measured collectives")
    sec.text(f"{len(paths)} run(s): {', '.join(sorted(df['run'].unique()))}. Each point is the median over "
             "samples of the maximum over ranks; busbw follows nccl-tests' definition.")
    colls = list(dict.fromkeys(df["collective"]))
    sec.figure(_grid(df, colls, "busbw_GBps", "busbw (GB/s)", ""),
               "Bus bandwidth against message size (log2 axis), per collective, group and tier.")
    small = df[df["bytes"] <= SMALL]
    if not small.empty:
        sec.figure(_grid(small, colls, "median_s", "time (us)", ": latency"),
                   "Time per call for messages up to 1 MiB, with the 95% confidence interval of the median.")

    peak = df.loc[df.groupby(["run", "group", "collective", "mode"])["busbw_GBps"].idxmax()]
    sec.heading("Measured peak")
    sec.table(peak[["run", "group", "tier", "mode", "collective", "bytes", "busbw_GBps", "algbw_GBps"]]
              .rename(columns={"bytes": "at bytes"}), "Highest median busbw of each collective.", "{:.1f}")
    sec.heading("Statistics per size")
    cols = ["run", "group", "mode", "collective", "bytes", "n", "median_s", "min_s", "max_s", "p95_s",
            "ci_lo_s", "ci_hi_s", "busbw_GBps", "wrong"]
    table = df[cols].copy()
    for c in ("median_s", "min_s", "max_s", "p95_s", "ci_lo_s", "ci_hi_s"):
        table[c.replace("_s", "_us")] = table.pop(c) * 1e6
    sec.table(table, "Times in microseconds; #wrong is -1 where the run did not check.", "{:.2f}")
    return [sec]
