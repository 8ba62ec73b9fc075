"""Report section for ``commtune.health`` records (python -m calibrate health): the node pairs as a
heat map of their fraction of the profile's bandwidth, the tables of pairs, ranks and the halving
search, and the suspects."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from calibrate.health import HealthRecord, Timed
from calibrate.sizes import format_size
from reports.html import Section


def build(paths: list[Path]) -> list[Section]:
    return [_section(HealthRecord.load(p), Path(p)) for p in paths]


def _frame(items: list[Timed]) -> pd.DataFrame:
    return pd.DataFrame([{"name": t.name, "measured ms": t.measured_s * 1e3, "expected ms": t.expected_s * 1e3,
                          "fraction of profile": t.fraction, "slow": "SLOW" if t.slow else ""} for t in items])


def _section(r: HealthRecord, path: Path) -> Section:
    cfg = r.config
    sec = Section(f"Cluster health: {len(r.hosts)} node(s) x {r.ranks_per_node} rank(s)")
    sec.text(f"Measured {r.created} against profile {r.profile!r}: {format_size(cfg.get('nbytes', 0))} exchanged per "
             f"rank, median of {cfg.get('iters')} exchanges. Fraction = the profile's expected time / the measured "
             f"time (the share of the profile's bandwidth delivered). An item is slow above {cfg.get('slow')} times "
             f"the typical (median) time of its kind.")
    if r.suspects:
        sec.table(pd.DataFrame([{"suspect": s.kind, "name": s.name, "why": s.why} for s in r.suspects]),
                  caption="What to suspect")
    else:
        sec.text("Nothing slow.")
    if r.pairs:
        m = r.matrix()
        n = len(r.hosts)
        fig, ax = plt.subplots(figsize=(1.2 + 0.6 * n, 0.9 + 0.6 * n))
        shown = np.ma.masked_invalid(m)
        im = ax.imshow(shown, cmap="RdYlGn", vmin=0.0, vmax=max(1.0, float(np.nanmax(m))))
        ax.set_xticks(range(n), r.hosts, rotation=45, ha="right")
        ax.set_yticks(range(n), r.hosts)
        for i in range(n):
            for j in range(n):
                if np.isfinite(m[i, j]):
                    ax.text(j, i, f"{m[i, j]:.0%}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax, label="fraction of the profile's bandwidth")
        sec.figure(fig, "Node pairs: each pair's fraction of the profile's inter-node bandwidth (red: slow)")
        sec.table(_frame(r.pairs), caption="Node pairs (every rank of one node exchanging with the other's)")
    if r.ranks:
        sec.table(_frame(r.ranks), caption="Ranks (a ring within each node)")
    if r.groups:
        sec.table(_frame(r.groups).assign(level=[g.level for g in r.groups]), caption="Halving search")
    sec.text(f"Source: {path}")
    return sec
