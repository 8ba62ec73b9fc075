"""Report sections for ``commtune.nccl-tune`` records (python -m autotune nccl: development, NCCL
default against NCCL tuned through the plugin and its ablations, measured in the same run) and
``commtune.nccl-evaluate`` records (python -m autotune nccl evaluate: the same arms at the held-out
sizes in a fresh process, the figures to quote)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from autotune.nccl.record import EvaluateRecord, TuneRecord, summary
from calibrate.sizes import format_size
from reports.html import Section


def build(paths: list[Path]) -> list[Section]:
    return [_section(TuneRecord.load(p), Path(p)) for p in paths]


def build_evaluate(paths: list[Path]) -> list[Section]:
    out = []
    for p in paths:
        r = EvaluateRecord.load(p)
        sec = Section(f"NCCL tuner, confirmatory evaluation ({r.ranks} ranks on {r.nodes} node(s))")
        sec.text(f"Measured on {r.device} with NCCL {r.nccl_version} ({r.date}, commit {r.commit or '?'}) by "
                 f"{r.command!r}, in a fresh process, at the sizes held out of development (declared "
                 f"{r.heldout.get('declared', '?')}, sha256 {r.heldout.get('sha256', '?')[:12]}): "
                 f"{r.heldout.get('evaluation')}. These are the figures to quote.")
        _comparison(sec, r.compare)
        sec.text(f"Development record: {r.development}. Source: {p}")
        out.append(sec)
    return out


def _comparison(sec: Section, compare: list) -> dict:
    s = summary(compare)
    sec.table(pd.DataFrame([{"collective": c, "geomean ratio": v["geomean"], "worst ratio": v["worst"],
                             "worst at": format_size(v["worst_bytes"]) if v["worst_bytes"] else "-",
                             "ratio at largest": v["largest_ratio"], "#wrong": v["wrong"],
                             **{f"{n} / default": x for n, x in v["against_default"].items()},
                             "targets": ", ".join(f"{t['target']}: {t['state']}" + (f" ({t['why']})" if t["why"] else "")
                                                  for t in v["verdicts"])} for c, v in s.items()]),
              caption="Per collective: tuned against NCCL's default, and each other arm's gain over the default "
                      "(min_ctas: NCCL_MIN_CTAS alone; table: the plugin's table alone; fixed: the sweep's best "
                      "single setting). Targets of issue 17: never slower than the default by more than 2%, "
                      "geometric mean >= 1.05x, allgather and reducescatter >= 1.15x at the largest size, #wrong 0; "
                      "unknown where an arm they are judged over did not run")
    sec.table(pd.DataFrame([{"collective": c.collective, "size": format_size(c.bytes), "default us": c.default_us,
                             "tuned us": c.tuned_us, "ratio": c.ratio, "setting": c.setting,
                             **{f"{a['name']} us": c.arm_us(a["name"]) for a in c.arms
                                if a["name"] not in ("default", "tuned")},
                             "NCCL ran (default)": c.default_runs, "NCCL ran (tuned)": c.tuned_runs,
                             "missing": "; ".join(f"{a['name']}: {a['status']} ({a['reason']})" for a in c.arms
                                                  if a["status"] != "ok"),
                             "#wrong": max(c.default_wrong, 0) + max(c.tuned_wrong, 0)} for c in compare]),
              caption="Per collective and size; setting: the table's algorithm/protocol/channels (auto: NCCL's own "
                      "channel count)")
    return s


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
    sec.text("Development figures: measured at the sizes the table was chosen on; only python -m autotune nccl "
             "evaluate (held-out sizes, fresh process) may be quoted.")
    s = _comparison(sec, r.compare)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for coll in s:
        pts = sorted((c.bytes, c.ratio) for c in r.compare if c.collective == coll and c.ratio is not None)
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
