"""The statistics of every comparison in the project, written once.

- ``median`` and ``median_ci``: the middle of timing samples and its distribution-free
  confidence interval (order statistics, Le Boudec, Performance Evaluation, section 2.2);
- ``geomean``: the geometric mean of ratios;
- ``spearman`` and ``kendall``: rank correlations of a model's predictions with
  measurements (ties get average ranks; None below 3 pairs or for a constant side);
- ``rel_err``: the one sign of a relative error, (predicted - measured) / measured,
  positive where the model over-estimates;
- ``ratio`` and ``ratio_ci``: a baseline's median over ours (above 1: ours is faster) and
  the interval that the two medians' intervals allow.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np


def median(values: Iterable[float]) -> float:
    """The median (mean of the two middle values for an even count); nan for no values."""
    x = np.asarray(list(values), dtype=float)
    return float(np.median(x)) if len(x) else math.nan


def median_ci(samples: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median from order statistics.

    The number of samples below the median is Binomial(n, 1/2); the interval is
    [x_(l), x_(u)] with l, u its two-sided quantiles. With fewer than 6 samples it
    spans min..max.
    """
    from scipy import stats as st

    x = np.sort(np.asarray(samples, dtype=float))
    n = len(x)
    if n == 0:
        return math.nan, math.nan
    if n < 6:
        return float(x[0]), float(x[-1])
    lo = int(st.binom.ppf((1 - confidence) / 2, n, 0.5))
    hi = int(st.binom.isf((1 - confidence) / 2, n, 0.5))
    lo = min(max(lo - 1, 0), n - 1)
    hi = min(max(hi, 0), n - 1)
    return float(x[lo]), float(x[hi])


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of positive values; nan for none, ValueError for a value <= 0."""
    x = list(values)
    if not x:
        return math.nan
    if any(not v > 0 for v in x):
        raise ValueError(f"geomean of a value <= 0 or nan: {min(x)}")
    return math.exp(sum(math.log(v) for v in x) / len(x))


def _pairs(x, y) -> tuple[np.ndarray, np.ndarray] | None:
    if len(x) != len(y):
        raise ValueError(f"rank correlation of {len(x)} against {len(y)} values")
    keep = [(a, b) for a, b in zip(x, y) if a is not None and b is not None
            and math.isfinite(a) and math.isfinite(b)]
    if len(keep) < 3:
        return None
    a, b = (np.asarray(v, dtype=float) for v in zip(*keep))
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return a, b


def spearman(x: Sequence[float | None], y: Sequence[float | None]) -> float | None:
    """Spearman's rho over the pairs where both are finite (ties: average ranks); None below 3
    pairs or where one side is constant."""
    from scipy.stats import rankdata

    p = _pairs(x, y)
    if p is None:
        return None
    r = float(np.corrcoef(rankdata(p[0]), rankdata(p[1]))[0, 1])
    return None if math.isnan(r) else r


def kendall(x: Sequence[float | None], y: Sequence[float | None]) -> float | None:
    """Kendall's tau-b over the pairs where both are finite; None below 3 pairs or for a constant side."""
    p = _pairs(x, y)
    if p is None:
        return None
    a, b = p
    da = np.sign(a[:, None] - a[None, :])
    db = np.sign(b[:, None] - b[None, :])
    iu = np.triu_indices(len(a), 1)
    da, db = da[iu], db[iu]
    n0 = len(da)
    ties_a, ties_b = int(np.sum(da == 0)), int(np.sum(db == 0))
    denom = math.sqrt((n0 - ties_a) * (n0 - ties_b))
    return float(np.sum(da * db) / denom) if denom else None


def rel_err(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured: positive where the prediction is too high; None where
    either is missing or the measurement is not positive."""
    if predicted is None or measured is None or not measured > 0 or not math.isfinite(predicted):
        return None
    return (predicted - measured) / measured


def rel_err_pct(predicted: float | None, measured: float | None) -> float:
    """``rel_err`` in percent, nan where it is None (for tables whose columns are numbers)."""
    e = rel_err(predicted, measured)
    return math.nan if e is None else e * 100


def ratio(base: float | None, ours: float | None) -> float | None:
    """base / ours (times): above 1 where ours is faster; None where either is missing."""
    if base is None or ours is None or not (base > 0 and ours > 0):
        return None
    return base / ours


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """n, median, min, max, p95 and the median's confidence interval of timing samples (seconds)."""
    x = np.asarray(samples, dtype=float)
    lo, hi = median_ci(x)
    return {"n": int(len(x)), "median_s": float(np.median(x)), "min_s": float(np.min(x)),
            "max_s": float(np.max(x)), "p95_s": float(np.percentile(x, 95)), "ci_lo_s": lo, "ci_hi_s": hi}
