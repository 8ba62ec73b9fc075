"""Report section for ``commtune.nccl-tune`` records (python -m autotune nccl): NCCL default
against NCCL tuned through the plugin, per collective and size, measured in the same run."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from autotune.nccl.record import TuneRecord, summary
from calibrate.sizes import format_size
from reports.html import Section


def build(paths: list[Path]) -> list[Section]:
    return [_section(TuneRecord.load(p), Path(p)) for p in paths]


def _section(r: TuneRecord, path: Path) -> Section:
    sec = Section(f"NCCL default against NCCL tuned ({r.ranks} ranks on {r.nodes} node(s))")
    sec.text(f"Measured on {r.device} with NCCL {r.nccl_version} ({r.date}): every candidate setting (algorithm x "
             f"protocol x channels) applied through commtune's tuner plugin on its own communicator of "
             f"{r.min_ctas} channels, the fastest per size band written to the plugin's table; then NCCL's default "
             f"and NCCL with the plugin and the table on new communicators, size by size in the same run. "
             f"CUDA graphs of {r.iters} calls, median of {r.rounds} interleaved rounds of {r.reps} replays, maximum "
             f"over ranks; every point checked "
             f"on fresh random data ({r.dtype}). Ratio = default time / tuned time.")
    if not r.compare:
        sec.text("The run stopped before NCCL default and tuned were compared: only the sweep is recorded.")
        sec.text(f"Source: {path}")
        return sec
    s = summary(r.compare)
    sec.table(pd.DataFrame([{"collective": c, "geomean ratio": v["geomean"], "worst ratio": v["worst"],
                             "worst at": format_size(v["worst_bytes"]), f"ratio at largest": v["largest_ratio"],
                             "#wrong": v["wrong"],
                             "targets": ", ".join(f"{k}: {'met' if ok else 'NOT met'}"
                                                  for k, ok in v["targets"].items())} for c, v in s.items()]),
              caption="Per collective (targets of issue 17: never slower than the default by more than 2%, "
                      "geometric mean >= 1.05x, allgather and reducescatter >= 1.15x at the largest size, #wrong 0)")
    sec.table(pd.DataFrame([{"collective": c.collective, "size": format_size(c.bytes), "default us": c.default_us,
                             "tuned us": c.tuned_us, "ratio": c.ratio, "setting": c.setting,
                             "NCCL ran (default)": c.default_runs, "NCCL ran (tuned)": c.tuned_runs,
                             "#wrong": max(c.default_wrong, 0) + max(c.tuned_wrong, 0)} for c in r.compare]),
              caption="Per collective and size; setting: the table's algorithm/protocol/channels (auto: NCCL's own "
                      "channel count)")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for coll in s:
        pts = sorted((c.bytes, c.ratio) for c in r.compare if c.collective == coll)
        ax.plot([b for b, _ in pts], [x for _, x in pts], marker="o", ms=3, label=coll)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axhline(1 / 1.02, color="red", lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes, whole buffer)")
    ax.set_ylabel("default / tuned")
    ax.legend(fontsize=7)
    sec.figure(fig, "NCCL default time over NCCL tuned time, per size (dotted: 2% slower)")
    secs = {k: round(v, 1) for k, v in r.seconds.items()}
    sec.text(f"Seconds: {secs}. Table: {r.table}; env file: {r.env_file}. Source: {path}")
    return sec
