"""Report section for ``schedule-tune`` results (python -m autotune schedule): per
collective, the chosen configuration per size band, predicted against measured
time of the measured candidates, and the tuned table's speedup over NCCL."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from autotune.schedule.result import NCCL, TuneResult
from reports.html import Section, size_text


def _num(x):
    return float("nan") if x is None else x


def build(paths: list[Path]) -> list[Section]:
    sections = []
    for path in paths:
        res = TuneResult.load(path)
        for coll in res.collectives:
            sections.append(_collective(res, coll, Path(path)))
    return sections


def _collective(res: TuneResult, coll, path: Path) -> Section:
    sec = Section(f"Schedule tuning: {coll.collective} on {res.ranks} GPUs ({res.nodes} node(s))")
    basis = coll.summary.get("basis", "predicted")
    if res.measured:
        sec.text(f"Measured on {res.device or 'GPUs'} ({res.date}) beside NCCL in the same run, CUDA graphs timed "
                 f"with CUDA events; the model (cost simulation on profile {res.profile}) ranked the candidates and "
                 f"chose what to measure. Tuning took {res.seconds.get('total', 0):.0f} s, "
                 f"{res.seconds.get('measure', 0):.0f} s of it measuring.")
    else:
        sec.text(f"Nothing was measured ({res.not_measured_reason}): every choice below comes from the model "
                 f"alone (cost simulation on profile {res.profile}, NCCL from the profile's fit of NCCL).")
    s = coll.summary
    fixed = s.get("speedup_over_fixed_geomean")
    sec.text(f"Basis of the choice: {basis} times. Tuned table over NCCL: "
             f"{_num(s.get('speedup_over_nccl_geomean')):.2f}x geometric mean, "
             f"{_num(s.get('speedup_over_nccl_min')):.2f}x in the worst band; over the best single fixed "
             f"configuration ({coll.fixed_baseline or 'none'}): {_num(fixed):.2f}x geometric mean.")
    rows = []
    for b in coll.bands:
        r = b.row(b.choice)
        c = coll.candidates.get(b.choice)
        rows.append({"from": size_text(b.lo), "to": size_text(b.hi) if b.hi else "no limit", "size": size_text(b.rep),
                     "choice": b.choice,
                     "protocol": c.protocol if c else "", "split": r.split if r else "",
                     "predicted us": b.nccl_predicted_us if b.choice == NCCL else r.predicted_us,
                     "measured us": _num(b.nccl_measured_us if b.choice == NCCL else r.measured_us),
                     "NCCL us": _num(b.nccl_measured_us if res.measured else b.nccl_predicted_us),
                     "Spearman": _num(b.spearman), "Spearman corrected": _num(b.spearman_corrected)})
    sec.table(pd.DataFrame(rows), caption="Chosen configuration per size band (NCCL: the band is left to the "
                                          "runtime's NCCL fallback). Spearman: model vs measured ranks of the "
                                          "measured candidates; corrected: with the per-protocol correction "
                                          "fitted on the other bands.")
    measured = [(b, r) for b in coll.bands for r in b.measured_rows()]
    if measured:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        protos = sorted({coll.candidates[r.key].protocol for _, r in measured})
        for p in protos:
            pts = [(r.predicted_us, r.measured_us) for _, r in measured if coll.candidates[r.key].protocol == p]
            ax.scatter([x for x, _ in pts], [y for _, y in pts], s=12, label=p)
        lo = min(min(r.predicted_us, r.measured_us) for _, r in measured)
        hi = max(max(r.predicted_us, r.measured_us) for _, r in measured)
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("predicted (us)")
        ax.set_ylabel("measured (us)")
        ax.legend(title="protocol")
        sec.figure(fig, "Predicted against measured time of every measured candidate (all bands)")
        below = s.get("bands_below_0.8") or []
        if below:
            sec.text(f"Bands where the model's ranking falls below Spearman 0.8: sizes {below}. The model "
                     f"(kernels/interp/model.py) charges launch, per-hop, per-tile and per-CUDA-block "
                     f"costs fitted on the interpreter's own sweep; the per-protocol correction (t = a + k t_model, "
                     f"fitted on the other bands) is what the 'corrected' column scores, and later runs rank with "
                     f"it through --correction model_correction.json. `python -m autotune schedule --rescore "
                     f"schedule.json` prints every prediction beside its measurement.")
    if not coll.bands:
        sec.text(f"No size band was tuned for {coll.collective}: nothing to chart.")
        sec.text(f"Source: {path}")
        return sec
    fig, ax = plt.subplots(figsize=(7, 3.6))
    nccl = [b.nccl_measured_us if res.measured else b.nccl_predicted_us for b in coll.bands]
    tuned = []
    for b in coll.bands:
        r = b.row(b.choice)
        if b.choice == NCCL:
            tuned.append(b.nccl_measured_us if res.measured else b.nccl_predicted_us)
        else:
            tuned.append(r.measured_us if res.measured else r.predicted_us)
    sizes = [b.rep for b in coll.bands]
    ax.plot(sizes, [_num(n) / _num(t) if n and t else float("nan") for n, t in zip(nccl, tuned)], marker="o",
            label="tuned table")
    if coll.fixed_baseline:
        fixed_t = []
        for b in coll.bands:
            r = b.row(coll.fixed_baseline)
            fixed_t.append(r.measured_us if res.measured else r.predicted_us)
        ax.plot(sizes, [_num(n) / _num(t) if n and t else float("nan") for n, t in zip(nccl, fixed_t)], marker="x",
                ls=":", label=f"fixed: {coll.fixed_baseline}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes, whole buffer)")
    ax.set_ylabel(f"speedup over NCCL ({basis})")
    ax.legend(fontsize=7)
    sec.figure(fig, f"Speedup over NCCL against size, {coll.collective}")
    if coll.notes:
        sec.text("Search-space notes: " + "; ".join(coll.notes))
    sec.text(f"Source: {path}")
    return sec
