"""Choose per band, merge bands into the tuned table, and score the result.

Measured bands: the fastest candidate that was measured and matched NCCL's
result, unless NCCL was at least as fast (then NCCL: the table leaves the band to
the runtime's NCCL fallback). Model-only bands: the same on predicted times, NCCL
predicted by the profile's fit of NCCL itself.
"""
from __future__ import annotations

from calibrate.measure.stats import geomean, spearman

from autotune.schedule.model import Correction
from autotune.schedule.result import NCCL, BandResult, CollectiveResult, TableEntry


def band_time(band: BandResult, key: str, measured: bool) -> float | None:
    if key == NCCL:
        return band.nccl_measured_us if measured else band.nccl_predicted_us
    r = band.row(key)
    if r is None or measured and not r.correct:
        return None
    return r.measured_us if measured else r.predicted_us


def choose_band(band: BandResult, measured: bool) -> str:
    options = [(band_time(band, r.key, measured), r.key) for r in band.rows]
    options = [(t, k) for t, k in options if t is not None]
    nccl = band_time(band, NCCL, measured)
    if not options:
        return NCCL
    best_t, best_k = min(options)
    return NCCL if nccl is not None and nccl <= best_t else best_k


def table(bands: list[BandResult]) -> list[TableEntry]:
    """Adjacent bands with the same choice merged; NCCL bands left out (the runtime falls back to NCCL)."""
    out: list[TableEntry] = []
    for b in bands:
        if b.choice == NCCL:
            continue
        if out and out[-1].choice == b.choice and out[-1].hi == b.lo:
            out[-1].hi = b.hi
        else:
            out.append(TableEntry(b.lo, b.hi, b.choice))
    return out


def fixed_baseline(bands: list[BandResult], measured: bool) -> tuple[str, float] | None:
    """The single candidate with the best geometric mean time over all bands (timed in all of them)."""
    best = None
    for key in [r.key for r in bands[0].rows]:
        ts = [band_time(b, key, measured) for b in bands]
        if any(t is None or t <= 0 for t in ts):
            continue
        g = geomean(ts)
        if best is None or g < best[1]:
            best = (key, g)
    return best


def correlations(bands: list[BandResult], protocol: dict[str, str]) -> Correction:
    """Spearman per band of the model as ranked, and of the interpreter model with the per-protocol
    correction fitted on the other bands (leave-one-band-out), over the band's distinct launches
    (``BandResult.distinct_measured``); returns the correction fitted on all bands. Rows need ``model_us``."""
    def points(bs):
        return [(protocol[r.key], r.model_us * 1e-6, r.measured_us * 1e-6) for b in bs for r in b.distinct_measured()]

    for i, b in enumerate(bands):
        rows = b.distinct_measured()
        b.spearman = spearman([r.predicted_us for r in rows], [r.measured_us for r in rows])
        corr = Correction.fit(points(bands[:i] + bands[i + 1:]))
        b.spearman_corrected = spearman([corr.apply(protocol[r.key], r.model_us * 1e-6) for r in rows],
                                        [r.measured_us for r in rows])
    return Correction.fit(points(bands), source="fitted on all measured bands")


def finish(res: CollectiveResult, measured: bool) -> None:
    """Fill choices, table, baseline and summary of ``res``."""
    for b in res.bands:
        b.choice = choose_band(b, measured)
    res.table = table(res.bands)
    tuned = [band_time(b, b.choice, measured) for b in res.bands]
    nccl = [band_time(b, NCCL, measured) for b in res.bands]
    # development figures: the tuned time per band is the best of the measured candidates (selection
    # bias: >= 1 over the fixed configuration by construction); python -m autotune schedule evaluate
    # re-measures at held-out sizes, as medians, for the figures to quote
    s: dict = {"basis": "measured" if measured else "predicted", "figures": "development: not to be quoted",
               "bands": len(res.bands),
               "bands_nccl": sum(b.choice == NCCL for b in res.bands)}
    if all(t is not None and t > 0 for t in nccl + tuned):
        ratios = [n / t for n, t in zip(nccl, tuned)]
        s["speedup_over_nccl_geomean"] = geomean(ratios)
        s["speedup_over_nccl_min"] = min(ratios)
    base = fixed_baseline(res.bands, measured)
    if base is not None:
        res.fixed_baseline = base[0]
        ts = [band_time(b, base[0], measured) for b in res.bands]
        s["speedup_over_fixed_geomean"] = geomean([f / t for f, t in zip(ts, tuned)])
    if measured:
        protocol = {k: c.protocol for k, c in res.candidates.items()}
        res.correction = correlations(res.bands, protocol).to_dict()
        sp = [b.spearman for b in res.bands if b.spearman is not None]
        spc = [b.spearman_corrected for b in res.bands if b.spearman_corrected is not None]
        s["spearman_min"] = min(sp) if sp else None
        s["spearman_corrected_min"] = min(spc) if spc else None
        # exactly 0.8 (4 launches, one adjacent pair swapped) meets the target despite rounding
        s["bands_below_0.8"] = [b.rep for b in res.bands if b.spearman is not None and b.spearman < 0.8 - 1e-9]
    res.summary = s
