"""Least-squares fits of the alpha-beta model (AutoDDL §3), piecewise over size.

For one collective, tier and group size p, the measured medians T(n) are fitted
to T(n) = a(p)*alpha + b(p)*n*beta (``ring_coefficients``) minimising the
squared *relative* error, with alpha, beta >= 0 (scipy's non-negative least
squares on rows scaled by 1/T). Measured curves bend where NCCL switches
protocol or algorithm, so the fit is piecewise: dynamic programming finds, for
each number of segments up to a bound, the contiguous split of the sorted sizes
with the least error, and the Bayesian information criterion picks the count.
Segment boundaries lie at the geometric mean of the neighbouring sizes.

Robustness: each size enters as the median of its samples (one outlier sample
cannot move it); no point is dropped.

Method "interpolate" (``fit_interpolated``) instead puts one alpha-beta segment
between each two neighbouring measured sizes: the line through both (exact for
an alpha-beta curve, so between two sizes of one protocol and algorithm it is
the curve itself), non-negative least squares where the line would need a
negative alpha or beta (a step inside the interval, or a time that falls).
With the sweep's sizes a factor 2 apart and the refinement's sizes bracketing
each step within 1/32 octave, it follows every step and every bend the
measurements show, where a few segments chosen by BIC smooth some of them away.
It does not average the noise of neighbouring sizes, but a size that is above
both its neighbours or below both (a spike or a dip of one size: a sample of
noise, or a size NCCL happens to run fast, such as a multiple of 8 KiB at
48-250 KiB) is taken at the median of the three: a step of NCCL's is monotone
over the sizes around it and keeps its values.

Both methods keep a fall in time from one size to the next only where it is real. A measured curve
can fall (NCCL's own thresholds switch to a faster algorithm or protocol a little late: the curve
steps down, and the NCCL tuner exists because of it), and the fit keeps such a fall. A fall smaller
than ``FLOOR`` (the least relative change that counts as a step) is noise of the medians on a loaded
host: those are pooled with their neighbours into their mean (``monotone``, pool-adjacent-violators
isotonic regression restricted to falls within the floor) before fitting, and the segments method
raises a segment's alpha by such a fall where it would start below the segment before it. Otherwise a
latency-bound curve could come out a few parts in ten thousand lower at 16 KiB than at 1 KiB, and a
planner would prefer padding messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from calibrate.collectives import Collective, busbw_factor, ring_coefficients
from calibrate.errors import OptionError, UserError
from calibrate.measure import stats
from calibrate.profile import METHODS, Segment, segments_time
from calibrate.refine import FLOOR, RESOLUTION, Point, flag_steps

BIG = float(2 ** 62)


def fit_alpha_beta(coll: Collective, p: int, n: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    """(alpha, beta, sum of squared relative residuals) for one segment."""
    a, b = ring_coefficients(coll, p)
    A = np.column_stack([np.full_like(n, a, dtype=float) / t, b * n / t])
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    x, _ = nnls(A / scale, np.ones_like(t), maxiter=200)
    alpha, beta = (x / scale).tolist()
    rel = (a * alpha + b * n * beta - t) / t
    return alpha, beta, float(rel @ rel)


def _bic(sse: float, npts: int, nseg: int) -> float:
    # 2 parameters per segment and a breakpoint between segments
    k = 3 * nseg - 1
    return npts * math.log(max(sse / npts, 1e-12)) + k * math.log(npts)


def fit_piecewise(coll: Collective, p: int, n, t, max_segments: int = 4, min_points: int = 3) -> list[Segment]:
    """Segments covering [0, inf) fitted to the points, made monotone first (module doc)."""
    n, t = _sorted_points(coll, p, n, t)
    t = monotone(t)
    N = len(n)
    min_points = max(2, min(min_points, N))
    cost: dict[tuple[int, int], tuple[float, float, float]] = {}
    for i in range(N):
        for j in range(i + min_points, N + 1):
            cost[(i, j)] = fit_alpha_beta(coll, p, n[i:j], t[i:j])
    # best[k][j]: least error of k segments covering points [0, j); back[k][j]: start of the last
    max_k = max(1, min(max_segments, N // min_points))
    inf = float("inf")
    best = [[inf] * (N + 1) for _ in range(max_k + 1)]
    back = [[-1] * (N + 1) for _ in range(max_k + 1)]
    best[0][0] = 0.0
    for k in range(1, max_k + 1):
        for j in range(1, N + 1):
            for i in range(0, j - min_points + 1):
                if best[k - 1][i] < inf and (i, j) in cost:
                    c = best[k - 1][i] + cost[(i, j)][2]
                    if c < best[k][j]:
                        best[k][j], back[k][j] = c, i
    k_best = min((k for k in range(1, max_k + 1) if best[k][N] < inf), key=lambda k: _bic(best[k][N], N, k))
    bounds, j = [], N
    for k in range(k_best, 0, -1):
        i = back[k][j]
        bounds.append((i, j))
        j = i
    bounds.reverse()
    segments = []
    for idx, (i, j) in enumerate(bounds):
        alpha, beta, sse = cost[(i, j)]
        lo = 0.0 if idx == 0 else math.sqrt(n[i - 1] * n[i])
        hi = BIG if idx == len(bounds) - 1 else math.sqrt(n[j - 1] * n[j])
        segments.append(Segment(lo, hi, alpha, beta, {"points": j - i, "rms_rel_err": math.sqrt(sse / (j - i)),
                                                      "first_bytes": float(n[i]), "last_bytes": float(n[j - 1])}))
    return _no_small_step_down(coll, p, segments)


def _no_small_step_down(coll: Collective, p: int, segments: list[Segment], floor: float = FLOOR) -> list[Segment]:
    """Each segment's alpha raised, where it would start below the segment before it by less than ``floor``
    (relative) across the gap between them (the last size of one, the first of the next, where
    ``segments_time`` blends the two): a boundary then steps down only by a real fall (module doc)."""
    a = ring_coefficients(coll, p)[0]
    out = segments[:1]
    for seg in segments[1:]:
        prev = out[-1]
        gap = (prev.fit["last_bytes"], seg.fit["first_bytes"])
        deficit = max(prev.time(coll, x, p) - seg.time(coll, x, p) for x in gap)
        if 0 < deficit <= floor * prev.time(coll, gap[1], p) and a > 0:
            seg = Segment(seg.min_bytes, seg.max_bytes, seg.alpha + deficit / a, seg.beta, seg.fit)
        out.append(seg)
    return out


def despike(t: np.ndarray, n: np.ndarray | None = None) -> np.ndarray:
    """Each inner value that is above both neighbours or below both, replaced by the median of the three; but
    (given the sizes ``n``) a value with a neighbour closer than ``RESOLUTION`` octaves whose time differs by
    more than ``FLOOR``: the two sides of a located step, a fall among them (sendrecv's at 256 MiB), kept."""
    out = np.array(t, dtype=float)
    for i in range(1, len(t) - 1):
        if n is not None and any(abs(math.log2(n[j] / n[i])) <= RESOLUTION + 1e-12 and abs(t[j] / t[i] - 1) > FLOOR
                                 for j in (i - 1, i + 1)):
            continue
        out[i] = float(np.median(t[i - 1:i + 2]))
    return out


def monotone(t: np.ndarray, floor: float = FLOOR) -> np.ndarray:
    """``t`` with each fall smaller than ``floor`` (relative) pooled away: adjacent values (or pooled
    blocks) where the later is below the earlier by at most ``floor`` are replaced by their mean (pool
    adjacent violators); a larger fall is kept (module doc)."""
    def falls_within_floor(a: list[float], b: list[float]) -> bool:
        ma, mb = a[0] / a[1], b[0] / b[1]
        return mb < ma <= mb * (1 + floor)

    blocks: list[list[float]] = []          # [sum, count] per pooled block
    for x in np.asarray(t, dtype=float):
        blocks.append([float(x), 1.0])
        while len(blocks) > 1 and falls_within_floor(blocks[-2], blocks[-1]):
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(c), s / c) for s, c in blocks]) if blocks else np.asarray(t, dtype=float)


def fit_interpolated(coll: Collective, p: int, n, t) -> list[Segment]:
    """One segment per interval between neighbouring sizes, through the despiked medians made monotone
    (see the module doc); the first extends to 0. Beyond the largest size, the line through it and the
    largest size at least an octave below it (``_open_end``)."""
    n, t = _sorted_points(coll, p, n, t)
    t = monotone(despike(t, n))

    def through(a: int, b: int, lo: float, hi: float) -> Segment:
        alpha, beta, sse = fit_alpha_beta(coll, p, n[[a, b]], t[[a, b]])
        return Segment(lo, hi, alpha, beta, {"points": 2, "rms_rel_err": math.sqrt(sse / 2),
                                             "first_bytes": float(n[a]), "last_bytes": float(n[b])})
    return [through(k, k + 1, 0.0 if k == 0 else float(n[k]), float(n[k + 1])) for k in range(len(n) - 1)] \
        + [through(_open_end(n), len(n) - 1, float(n[-1]), BIG)]


def _open_end(n: np.ndarray) -> int:
    """The index of the largest size at most half the largest (the one before it where there is none): the
    slope beyond the measured sizes taken over an octave, not between two refined sizes a few parts in a
    hundred apart (2 x H200, 2026-11-29: allgather's last two sizes, 696 and 704 MiB, gave a slope of about
    zero, and the fit read 799 MiB 11.7% fast)."""
    below = np.nonzero(n <= n[-1] / 2)[0]
    return int(below[-1]) if below.size else max(len(n) - 2, 0)


def fit_curve(method: str, coll: Collective, p: int, n, t, max_segments: int = 4, min_points: int = 3) -> list[Segment]:
    """The segments of one curve by ``method`` (one of ``METHODS``)."""
    if method == "interpolate":
        return fit_interpolated(coll, p, n, t)
    if method == "segments":
        return fit_piecewise(coll, p, n, t, max_segments, min_points)
    raise OptionError("method", f"{method!r} is not a fit method: choose from {', '.join(METHODS)}")


def _sorted_points(coll: Collective, p: int, n, t) -> tuple[np.ndarray, np.ndarray]:
    n = np.asarray(n, dtype=float)
    t = np.asarray(t, dtype=float)
    order = np.argsort(n)
    n, t = n[order], t[order]
    if len(n) < 2:
        raise UserError(f"{coll.value} at p={p}: {len(n)} size(s) measured, at least 2 are needed to fit alpha and beta")
    if not (np.all(np.isfinite(t)) and np.all(t > 0) and np.all(np.isfinite(n))):
        raise UserError(f"{coll.value} at p={p}: the measurements contain non-finite or non-positive times: measure again")
    return n, t


def measured_steps(n, t, ci_lo, ci_hi, floor: float = FLOOR, resolution: float = RESOLUTION) -> list[dict]:
    """Where the measured curve steps (``calibrate.refine.flag_steps`` on the points, with their
    confidence intervals): per step the last size below it and the first above, the gap between them
    in octaves, the jump (time above over time below, as the smooth models on each side see it) and
    whether the gap is within ``resolution`` octaves."""
    pts = [Point(int(a), float(b), float(lo), float(hi)) for a, b, lo, hi in zip(n, t, ci_lo, ci_hi)]
    out = []
    for s in flag_steps(pts, floor):
        out.append({"last_below_bytes": float(s.lo.nbytes), "first_above_bytes": float(s.hi.nbytes),
                    "at_bytes": math.sqrt(s.lo.nbytes * s.hi.nbytes), "gap_octaves": s.width,
                    "jump": s.hi.time_s / s.lo.time_s, "located": s.located(resolution)})
    return out


def switches(coll: Collective, p: int, segments: list[Segment], resolution: float = 1 / 32) -> list[dict]:
    """Where the fitted curve steps: per boundary between segments, the last size measured below it and
    the first above, the gap between them in octaves, the jump (time of the upper segment over the lower
    one at the gap's geometric middle) and whether the gap is within ``resolution`` octaves."""
    out = []
    for lo, hi in zip(segments, segments[1:]):
        last, first = lo.fit.get("last_bytes"), hi.fit.get("first_bytes")
        if not last or not first:
            continue
        at = math.sqrt(last * first)
        gap = math.log2(first / last)
        t_lo = lo.time(coll, at, p)
        out.append({"last_below_bytes": last, "first_above_bytes": first, "at_bytes": at, "gap_octaves": gap,
                    "jump": hi.time(coll, at, p) / t_lo if t_lo > 0 else None,  # None: no finite ratio
                    "located": gap <= resolution + 1e-9})
    return out


def predict(coll: Collective, p: int, segments: list[Segment], n) -> np.ndarray:
    return np.asarray([segments_time(coll, p, segments, float(x)) for x in np.atleast_1d(n)])


@dataclass
class Validation:
    """Held-out errors: fitted on every other size, judged on the sizes left out."""

    points: int
    median_abs_rel_err: float
    max_abs_rel_err: float
    r2_log: float
    rows: list[tuple[float, float, float]]  # (bytes, measured s, predicted s)

    def as_dict(self) -> dict:
        return {"method": "hold out every other size", "held_out_points": self.points,
                "median_abs_rel_err": self.median_abs_rel_err, "max_abs_rel_err": self.max_abs_rel_err,
                "r2_log_time": self.r2_log}


# below these a fit is flagged, whatever the timing mode (issue 20: r2 -0.45 and 90% went unremarked)
MIN_R2, MAX_HELDOUT_ERR = 0.9, 0.5


def fit_quality_problem(r2: float | None, max_err: float | None) -> str | None:
    """What is wrong with a fit whose held-out log-time r2 and max relative error are these, or None."""
    bad = []
    if r2 is not None and math.isfinite(r2) and r2 < MIN_R2:
        bad.append(f"r2 {r2:.2f} (want >= {MIN_R2})")
    if max_err is not None and math.isfinite(max_err) and max_err > MAX_HELDOUT_ERR:
        bad.append(f"held-out max error {max_err:.0%} (want <= {MAX_HELDOUT_ERR:.0%})")
    return ", ".join(bad) or None


def holdout(coll: Collective, p: int, n, t, max_segments: int = 4, min_points: int = 3,
            method: str = "segments") -> Validation | None:
    """Fit on the even-indexed sizes, predict the odd ones. None with fewer than 6 sizes."""
    n = np.asarray(n, dtype=float)
    t = np.asarray(t, dtype=float)
    order = np.argsort(n)
    n, t = n[order], t[order]
    if len(n) < 6:
        return None
    train, test = np.arange(0, len(n), 2), np.arange(1, len(n), 2)
    segs = fit_curve(method, coll, p, n[train], t[train], max_segments, min_points)
    pred = predict(coll, p, segs, n[test])
    rel = np.abs(pred - t[test]) / t[test]
    lt, lp = np.log(t[test]), np.log(np.maximum(pred, 1e-15))
    ss_tot = float(((lt - lt.mean()) ** 2).sum())
    r2 = 1 - float(((lt - lp) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return Validation(len(test), stats.median(rel), float(rel.max()), r2,
                      list(zip(n[test].tolist(), t[test].tolist(), pred.tolist())))


def implied_busbw(coll: Collective, p: int, segments: list[Segment]) -> float:
    """Bus bandwidth (bytes/s) that the largest-size segment implies: busbw-factor / (b(p)*beta).

    On a flat fabric this is the same for every p; ``calibrate fit`` flags it when it is not.
    """
    beta = segments[-1].beta
    _, b = ring_coefficients(coll, p)
    return busbw_factor(coll, p) / (b * beta) if beta > 0 else float("inf")
