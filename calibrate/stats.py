"""Robust per-size statistics of timing samples."""
from __future__ import annotations

import math

import numpy as np
from scipy import stats as _st


def median_ci(samples: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median from order statistics.

    The number of samples below the median is Binomial(n, 1/2); the interval is
    [x_(l), x_(u)] with l, u its two-sided quantiles (Le Boudec, Performance
    Evaluation, §2.2). With fewer than 6 samples it spans min..max.
    """
    x = np.sort(np.asarray(samples, dtype=float))
    n = len(x)
    if n == 0:
        return math.nan, math.nan
    if n < 6:
        return float(x[0]), float(x[-1])
    lo = int(_st.binom.ppf((1 - confidence) / 2, n, 0.5))
    hi = int(_st.binom.isf((1 - confidence) / 2, n, 0.5))
    lo = min(max(lo - 1, 0), n - 1)
    hi = min(max(hi, 0), n - 1)
    return float(x[lo]), float(x[hi])


def summarize(samples: np.ndarray) -> dict[str, float]:
    x = np.asarray(samples, dtype=float)
    lo, hi = median_ci(x)
    return {
        "n": int(len(x)),
        "median_s": float(np.median(x)),
        "min_s": float(np.min(x)),
        "max_s": float(np.max(x)),
        "p95_s": float(np.percentile(x, 95)),
        "ci_lo_s": lo,
        "ci_hi_s": hi,
    }
