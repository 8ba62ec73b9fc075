"""From the measured settings to the table: per collective and size band, among the settings
measured at every size of the band that NCCL's default was measured at (a setting dropped there
or never measured there is never chosen), the fastest (geometric mean over those sizes of its time
over the default's; median time, maximum over ranks), unless it beats the default's own algorithm
and protocol with NCCL's channel count by no more than ``margin``: then that one, which at the sizes
where NCCL cuts its channels by size is NCCL's default itself (so noise never trades the default for
a setting that is no faster). A band gets no row (NCCL decides there) where NCCL's default or no
setting was measured, or where the setting chosen is slower than the default by more than ``margin``.

Bands are ``autotune.nccl.bands``: band i holds size s_i and runs from the geometric
mean of s_(i-1) and s_i to that of s_i and s_(i+1), the first from 0 and the last without
an upper bound, so the table covers every size of each tuned collective. NCCL's default is
measured beside the settings but is never a row: the tuned communicators have
``min_ctas`` channels, where 'no row' would be NCCL's choice for that many channels, not
its default; a setting with NCCL's own channel count (``/auto``) and the default's
algorithm and protocol is what reproduces the default there.
"""
from __future__ import annotations

from calibrate.errors import UserError
from calibrate.measure.stats import geomean
from kernels.nccl_tuner.table import SIZE_MAX, Row, merge_bands

from autotune.nccl.record import Sample
from autotune.nccl.settings import Setting
from autotune.nccl.bands import Band, bands_for


def pick(samples: list[Sample], band: Band, margin: float) -> str | None:
    """The label chosen for ``band`` from the samples of one collective (NCCL's default among them)."""
    defaults = {s.bytes: s for s in samples if s.setting == "default" and band.covers(s.bytes)}
    if not defaults:
        return None
    times: dict[str, dict[int, float]] = {}
    for s in samples:
        if s.setting != "default" and s.bytes in defaults:
            times.setdefault(s.setting, {})[s.bytes] = s.median_us
    score = {label: geomean(t[n] / d.median_us for n, d in defaults.items())
             for label, t in times.items() if len(t) == len(defaults)}
    if not score:
        return None
    best = min(score, key=score.get)
    runs = {d.runs for d in defaults.values()}
    own = f"{runs.pop()}/auto" if len(runs) == 1 and "" not in runs else None
    if own in score and score[best] >= score[own] * (1 - margin):
        best = own
    return best if score[best] <= 1 + margin else None


def choose(sweep: list[Sample], collectives: list[str], sizes: list[int], ranks: int, nodes: int,
           excluded=(), margin: float = 0.02) -> list[Row]:
    """The table's rows: one per band and collective, neighbouring bands of one setting merged;
    ``excluded``: labels of settings NCCL did not apply."""
    rows = []
    for coll in collectives:
        mine = [s for s in sweep if s.collective == coll and s.setting not in excluded]
        if not any(s.setting != "default" for s in mine):
            raise UserError(f"no setting of {coll} was measured: nothing to choose from")
        for band in bands_for(sizes):
            label = pick(mine, band, margin)
            if label is not None:
                rows.append(Setting.parse(label).row(coll, band.lo, SIZE_MAX if band.hi == 0 else band.hi - 1,
                                                     ranks, nodes))
    return merge_bands(rows)


def best_fixed(sweep: list[Sample], collective: str, excluded=()) -> str | None:
    """The one setting that would do best at every size of ``collective`` on its own: among the settings
    measured at every size NCCL's default was (NCCL applied them), the least geometric mean of its time
    over the default's. The baseline a per-size table must beat to be worth its bands."""
    mine = [s for s in sweep if s.collective == collective and s.setting not in excluded]
    defaults = {s.bytes: s.median_us for s in mine if s.setting == "default"}
    times: dict[str, dict[int, float]] = {}
    for s in mine:
        if s.setting != "default" and s.bytes in defaults:
            times.setdefault(s.setting, {})[s.bytes] = s.median_us
    score = {label: geomean(t[n] / defaults[n] for n in defaults) for label, t in times.items()
             if len(t) == len(defaults)}
    return min(score, key=score.get) if score else None
