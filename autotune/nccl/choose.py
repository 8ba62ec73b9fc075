"""From the measured settings to the table: per collective and size band, the fastest
setting measured at the band's size (median time, maximum over ranks), unless it beats the
default's own algorithm and protocol with NCCL's channel count by no more than ``margin``:
then that one, which at the sizes where NCCL cuts its channels by size is NCCL's default
itself (so noise never trades the default for a setting that is no faster).

Bands are ``autotune.schedule.bands``: band i holds size s_i and runs from the geometric
mean of s_(i-1) and s_i to that of s_i and s_(i+1), the first from 0 and the last without
an upper bound, so the table covers every size of each tuned collective. NCCL's default is
measured beside the settings but is never a row: the tuned communicators have
``min_ctas`` channels, where 'no row' would be NCCL's choice for that many channels, not
its default; a setting with NCCL's own channel count (``/auto``) and the default's
algorithm and protocol is what reproduces the default there.
"""
from __future__ import annotations

from calibrate.errors import UserError
from kernels.nccl_tuner.table import SIZE_MAX, Row, merge_bands

from autotune.nccl.record import Sample
from autotune.nccl.settings import Setting
from autotune.schedule.bands import bands_for


def best_per_size(sweep: list[Sample], collective: str, excluded=()) -> dict[int, Sample]:
    """The fastest sample of ``collective`` at each measured size, but NCCL's default's and ``excluded``."""
    best: dict[int, Sample] = {}
    for s in sweep:
        if s.collective != collective or s.setting == "default" or s.setting in excluded:
            continue
        if s.bytes not in best or s.median_us < best[s.bytes].median_us:
            best[s.bytes] = s
    return best


def choose(sweep: list[Sample], collectives: list[str], sizes: list[int], ranks: int, nodes: int,
           excluded=(), margin: float = 0.02) -> list[Row]:
    """The table's rows: one per band and collective, neighbouring bands of one setting merged;
    ``excluded``: labels of settings NCCL did not apply."""
    rows = []
    for coll in collectives:
        best = best_per_size(sweep, coll, excluded)
        measured = sorted(best)
        if not measured:
            raise UserError(f"no setting of {coll} was measured: nothing to choose from")
        by_label = {(s.bytes, s.setting): s for s in sweep if s.collective == coll and s.setting not in excluded}
        for band in bands_for(sizes):
            # the sample measured at the band's size (sizes are aligned to the element count and ranks)
            rep = min(measured, key=lambda b: abs(b - band.rep))
            pick = best[rep]
            default = by_label.get((rep, "default"))
            own = by_label.get((rep, f"{default.runs}/auto")) if default is not None and default.runs else None
            if own is not None and pick.median_us >= own.median_us * (1 - margin):
                pick = own
            s = Setting.parse(pick.setting)
            rows.append(s.row(coll, band.lo, SIZE_MAX if band.hi == 0 else band.hi - 1, ranks, nodes))
    return merge_bands(rows)
