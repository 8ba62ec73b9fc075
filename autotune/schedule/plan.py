"""Rank every candidate in every band with the model, and pick what to measure.

Measured in a band, one row per distinct launch (``launch_signature``): the ``candidates``
candidates the model ranks best there, the
best ``candidates // 2`` (at least 1) of each protocol (the model is weakest at
ranking across protocols, whose fixed costs differ most, so measurement must
see each), plus the fixed-configuration contenders, measured in every band so that the best
single fixed configuration can be compared with the tuned table: the model's
winner of each band and the ``FIXED_CONTENDERS`` candidates with the best
geometric mean of predicted time over all bands.
"""
from __future__ import annotations

import sys

from calibrate.measure.stats import geomean

from autotune.nccl.bands import Band
from autotune.schedule.model import Model
from autotune.schedule.result import BandResult, Row, launch_signature
from autotune.schedule.space import Built

FIXED_CONTENDERS = 2


def rank_bands(model: Model, built: list[Built], bands: list[Band], progress=None) -> list[BandResult]:
    """Every candidate's simulated and predicted time in every band, best first."""
    out = []
    for i, band in enumerate(bands):
        rows = []
        for b in built:
            rows.append(Row(b.candidate.key, model.split(b, band.rep), model.simulated(b, band.rep) * 1e6,
                            model.predict(b, band.rep) * 1e6, model_us=model.model_seconds(b, band.rep) * 1e6))
        rows.sort(key=lambda r: (r.predicted_us, r.key))
        out.append(BandResult(band.rep, band.lo, band.hi, model.nccl(band.rep) * 1e6, rows))
        if progress:
            progress(f"band {i + 1}/{len(bands)} {band.label} at {band.rep} B: model best {rows[0].key} "
                     f"{rows[0].predicted_us:.1f} us, NCCL {out[-1].nccl_predicted_us:.1f} us")
    return out


def fixed_contenders(bands: list[BandResult], n: int = FIXED_CONTENDERS) -> list[str]:
    """Band winners, then the ``n`` candidates with the best predicted geometric mean over all bands."""
    winners = list(dict.fromkeys(b.rows[0].key for b in bands))
    keys = [r.key for r in bands[0].rows]
    by_key = [{r.key: r.predicted_us for r in b.rows} for b in bands]
    overall = sorted(keys, key=lambda k: (geomean([m[k] for m in by_key]), k))
    return list(dict.fromkeys(winners + overall[:n]))


def select(bands: list[BandResult], candidates: int, protocol: dict[str, str]) -> None:
    """Mark the rows to measure (``Row.selected``); ``protocol``: candidate key -> protocol."""
    contenders = set(fixed_contenders(bands))
    per_protocol = max(1, candidates // 2)
    for b in bands:
        seen: dict[str, int] = {}
        launches: set[tuple] = set()
        taken = 0
        for r in b.rows:
            sig = launch_signature(r)
            if sig in launches:  # the same launch as a row already taken: measure it only as a contender
                r.selected = r.key in contenders
                continue
            p = protocol[r.key]
            seen[p] = seen.get(p, 0) + 1
            r.selected = taken < candidates or seen[p] <= per_protocol or r.key in contenders
            if r.selected:
                launches.add(sig)
            taken += 1


def log(msg: str) -> None:
    print(f"[schedule] {msg}", file=sys.stderr, flush=True)
