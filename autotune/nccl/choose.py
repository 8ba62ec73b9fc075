"""From the measured settings to the table: per collective and size band, among the settings
measured at every size of the band that NCCL's default was measured at (a setting dropped there
or never measured there is never chosen), the fastest (geometric mean over those sizes of its time
over the default's; median time, maximum over ranks), unless it beats the default's own algorithm
and protocol with NCCL's channel count by no more than ``margin``: then that one, which at the sizes
where NCCL cuts its channels by size is NCCL's default itself (so noise never trades the default for
a setting that is no faster). A band gets no row (NCCL decides there) where NCCL's default or no
setting was measured, or where the setting chosen is slower than the default by more than ``margin``.

A band's row stands only where its gain is confirmed at sizes the choice did not see
(``confirm``: two sizes inside each band, a quarter of the sweep's step either side of the
size it was chosen at, off the sweep's grid and the held-out set of ``evaluate``, measured
after the choice in the same run): the setting's time over the default's, geometric mean
over those sizes, at least ``margin`` faster and nowhere slower than the default by more
than ``margin``. Elsewhere NCCL decides (no row); a collective with no confirmed gain gets
no rows at all, and the command says so.

Bands are ``autotune.nccl.bands``: band i holds size s_i and runs from the geometric
mean of s_(i-1) and s_i to that of s_i and s_(i+1), the first from 0 and the last without
an upper bound, so the table covers every size of each tuned collective. NCCL's default is
measured beside the settings but is never a row: the tuned communicators have
``min_ctas`` channels, where 'no row' would be NCCL's choice for that many channels, not
its default; a setting with NCCL's own channel count (``/auto``) and the default's
algorithm and protocol is what reproduces the default there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from calibrate.errors import UserError
from calibrate.measure import stats
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
    score = _scores(samples, {n: d.median_us for n, d in defaults.items()})
    if not score:
        return None
    best = min(score, key=score.get)
    runs = {d.runs for d in defaults.values()}
    own = f"{runs.pop()}/auto" if len(runs) == 1 and "" not in runs else None
    if own in score and score[best] >= score[own] * (1 - margin):
        best = own
    return best if score[best] <= 1 + margin else None


def _scores(samples: list[Sample], defaults: dict[int, float]) -> dict[str, float]:
    """Per setting of ``samples`` measured at every size of ``defaults`` (size -> the default's median): the
    geometric mean over those sizes of its time over the default's."""
    times: dict[str, dict[int, float]] = {}
    for s in samples:
        if s.setting != "default" and s.bytes in defaults:
            times.setdefault(s.setting, {})[s.bytes] = s.median_us
    return {label: geomean(t[n] / defaults[n] for n in defaults) for label, t in times.items()
            if len(t) == len(defaults)}


@dataclass(frozen=True)
class Pick:
    """The setting chosen for one band of one collective."""

    collective: str
    band: Band
    label: str


def picks(sweep: list[Sample], collectives: list[str], sizes: list[int], excluded=(),
          margin: float = 0.02) -> list[Pick]:
    """The setting chosen per band and collective from the sweep (bands without one: NCCL decides);
    ``excluded``: labels of settings NCCL did not apply."""
    out = []
    for coll in collectives:
        mine = [s for s in sweep if s.collective == coll and s.setting not in excluded]
        if not any(s.setting != "default" for s in mine):
            raise UserError(f"no setting of {coll} was measured: nothing to choose from")
        for band in bands_for(sizes):
            label = pick(mine, band, margin)
            if label is not None:
                out.append(Pick(coll, band, label))
    return out


def rows_of(chosen: list[Pick], ranks: int, nodes: int) -> list[Row]:
    """The table's rows: one per pick, neighbouring bands of one setting merged."""
    return merge_bands([Setting.parse(p.label).row(p.collective, p.band.lo,
                                                   SIZE_MAX if p.band.hi == 0 else p.band.hi - 1, ranks, nodes)
                        for p in chosen])


def confirmation_sizes(sizes: list[int], unit: int, avoid=()) -> list[int]:
    """Two sizes inside each band (a quarter of the step to the neighbouring sweep size either side of
    the band's own; at the ends, the step to the one neighbour mirrored), multiples of
    ``unit`` bytes, none on the sweep's grid or in ``avoid`` (the held-out sizes)."""
    s = sorted(sizes)
    taken = set(s) | set(avoid)
    out = set()
    for i, n in enumerate(s):
        down = s[i - 1] if i else (n * n / s[1] if len(s) > 1 else n / 2)
        up = s[i + 1] if i + 1 < len(s) else (n * n / s[i - 1] if i else 2 * n)
        for other in (down, up):
            m = max(unit, round(n * (other / n) ** 0.25 / unit) * unit)
            while m in taken:
                m += unit
            out.add(m)
    return sorted(m for m in out if m <= s[-1])


@dataclass(frozen=True)
class Confirmation:
    pick: Pick
    gain: float | None       # geomean of default / setting over the band's confirmation sizes
    worst: float | None      # the least of them
    sizes: int
    kept: bool

    def line(self) -> str:
        b = self.pick.band
        if self.gain is None:
            return f"{self.pick.collective} {b.label} {self.pick.label}: not confirmed (not measured there)"
        return (f"{self.pick.collective} {b.label} {self.pick.label}: {self.gain:.3f}x the default (worst "
                f"{self.worst:.3f}x) at {self.sizes} confirmation sizes: {'kept' if self.kept else 'dropped'}")


def confirm(chosen: list[Pick], samples: list[Sample], margin: float = 0.02) -> list[Confirmation]:
    """Each pick judged at the confirmation sizes of its band (``samples``: the default and the picks'
    settings measured there): kept where the setting is faster than the default by more than ``margin``
    (geometric mean) and nowhere slower than it by more than ``margin``."""
    out = []
    for p in chosen:
        mine = {s.bytes: s.median_us for s in samples
                if s.collective == p.collective and s.setting == p.label and p.band.covers(s.bytes)}
        default = {s.bytes: s.median_us for s in samples
                   if s.collective == p.collective and s.setting == "default" and p.band.covers(s.bytes)}
        ratios = [default[n] / mine[n] for n in mine if n in default and mine[n] > 0
                  and math.isfinite(mine[n]) and math.isfinite(default[n])]
        if not ratios:
            out.append(Confirmation(p, None, None, 0, False))
            continue
        gain, worst = geomean(ratios), min(ratios)
        out.append(Confirmation(p, gain, worst, len(ratios), gain >= 1 + margin and worst >= 1 - margin))
    return out


def declined(collectives: list[str], confirmations: list[Confirmation]) -> list[str]:
    """The collectives left with no confirmed row (NCCL decides at every size)."""
    return [c for c in collectives if not any(x.kept and x.pick.collective == c for x in confirmations)]


def best_fixed(sweep: list[Sample], collective: str, excluded=()) -> str | None:
    """The one setting that would do best at every size of ``collective`` on its own: among the settings
    measured at every size NCCL's default was (NCCL applied them), the least geometric mean of its time
    over the default's. The baseline a per-size table must beat to be worth its bands."""
    mine = [s for s in sweep if s.collective == collective and s.setting not in excluded]
    score = _scores(mine, {s.bytes: s.median_us for s in mine if s.setting == "default"})
    return min(score, key=score.get) if score else None


def heldout_declines(compare: list, margin: float = 0.02, collectives=(), arm: str = "tuned") -> dict[str, str]:
    """The collectives whose table is declined at ``evaluate``'s held-out sizes (``compare``: its
    rows), with why: ``arm`` (``tuned``: the table with NCCL_MIN_CTAS, as the env file runs NCCL;
    ``table``: the table alone) slower than NCCL's default by more than ``margin`` at some held-out
    size, or its gain not confirmed there (geometric mean of default / arm over the held-out sizes a
    row covers at most 1 + ``margin``, or no held-out size falls in a row). Declined: no rows for it,
    NCCL decides. ``collectives``: those of the table, declined where not measured."""
    out = {}
    for coll in dict.fromkeys([*collectives, *(c.collective for c in compare)]):
        mine = [(c, stats.ratio(c.default_us, c.arm_us(arm))) for c in compare if c.collective == coll]
        if not mine:
            out[coll] = "not measured at the held-out sizes: nothing is confirmed"
            continue
        slow = [(c, x) for c, x in mine if x is not None and x < 1 - margin]
        covered = [x for c, x in mine if c.setting != "default" and x is not None]
        if slow:
            worst, x = min(slow, key=lambda cx: cx[1])
            out[coll] = f"{x:.3f}x NCCL's default at {worst.bytes} B (slower by more than {margin:.0%})"
        elif any(x is None for _, x in mine):
            out[coll] = "an arm did not run at some held-out size: nothing is confirmed"
        elif not covered:
            out[coll] = "no held-out size falls in its rows: the gain is not confirmed"
        elif geomean(covered) <= 1 + margin:
            out[coll] = (f"{geomean(covered):.3f}x NCCL's default over the {len(covered)} held-out sizes its rows "
                         f"cover (not faster by more than {margin:.0%})")
    return out


def floor_costs(compare: list, collectives, margin: float = 0.02) -> str | None:
    """Why NCCL_MIN_CTAS cannot stay in the env file once ``collectives`` are declined (it reaches every
    collective of the job: a declined one runs with it alone, the ``min_ctas`` arm): that arm slower
    than NCCL's default by more than ``margin`` at a held-out size, or not measured; None: it may stay."""
    for c in compare:
        if c.collective in collectives:
            x = stats.ratio(c.default_us, c.arm_us("min_ctas"))
            if x is None:
                return f"{c.collective} at {c.bytes} B: NCCL_MIN_CTAS alone was not measured"
            if x < 1 - margin:
                return f"{c.collective} at {c.bytes} B: NCCL_MIN_CTAS alone {x:.3f}x NCCL's default"
    return None
