"""Report section for ``kernels-bench`` results: the interpreter against NCCL,
speedup against size per collective (the shape of GC3's Fig. 7)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from calibrate.errors import UserError
from kernels.interp.records import BenchRecord
from reports.html import Section


def load_rows(paths: list[Path]) -> pd.DataFrame:
    frames = []
    for p in paths:
        p = Path(p)
        rec = BenchRecord.load(p / "bench.json" if p.is_dir() else p)
        df = pd.DataFrame(rec.rows)
        df["device"] = rec.device
        df["date"] = rec.date
        frames.append(df)
    if not frames:
        raise UserError("no kernels bench results given")
    return pd.concat(frames, ignore_index=True)


def build(paths: list[Path]) -> list[Section]:
    df = load_rows(paths)
    sec = Section("GC3 interpreter against NCCL")
    dev = ", ".join(sorted(set(df["device"]) - {""})) or "unknown device"
    sec.text(f"Both sides in the same run on the same buffers ({dev}), each a CUDA graph of N calls timed with "
             f"CUDA events; speedup = NCCL time / interpreter time (above 1: the interpreter is faster). "
             f"Every point was checked against NCCL's result on random data before timing.")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for coll, g in df.groupby("collective", sort=False):
        g = g.sort_values("bytes")
        ax.plot(g["bytes"], g["speedup"], marker="o", label=coll)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes, whole buffer)")
    ax.set_ylabel("speedup over NCCL")
    ax.legend()
    sec.figure(fig, "Speedup of the interpreter over NCCL against size, per collective")
    wrong = int((~df["correct"].astype(bool)).sum())
    if wrong:
        sec.text(f"{wrong} points did NOT match NCCL's result; their timings are not meaningful.")
    cols = ["collective", "bytes", "program", "protocol", "split", "interp_us", "nccl_us", "interp_busbw_gbs",
            "nccl_busbw_gbs", "speedup", "correct"]
    sec.table(df[cols], caption="busbw as nccl-tests defines it; times per call in microseconds")
    return [sec]
