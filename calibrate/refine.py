"""Adaptive refinement of a size sweep: find the steps in a measured curve and
locate each one by bisection.

NCCL switches protocol (LL, LL128, Simple), algorithm or channel count at
sizes of its own choosing, and the time jumps there (2 x H200, graph mode:
allreduce x1.69 between 1.375 and 2 MiB). A geometric sweep steps over these
points, and a fit cannot tell where inside the gap the jump lies. Here:

1. every interval of the sweep is compared with the smooth model on each side:
   the alpha-beta line through the two points to its left, extrapolated to its
   right end, and the line through the two points to its right, extrapolated
   to its left end (a line through two points of an alpha-beta curve is that
   curve, so a smooth stretch agrees with both). An interval is flagged when
   both extrapolations miss the measured end by more than the noise (the
   half-widths of the two end points' confidence intervals of the median, at
   least ``floor``); at the ends of the sweep the one side that exists decides;
2. each flagged interval is bisected on aligned sizes: the time at the
   midpoint is closer (in log) to the left line or to the right one, and the
   step lies in the other half. Intervals are taken in order of jump times
   width (the largest possible error first), until each is narrower than
   ``resolution`` octaves, or the point or time budget is spent.

Everything here is deterministic in the measured values, so a resumed run
(which gets the points already on disk back from ``measure``) replays the same
decisions and measures only what is missing.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable

from calibrate.sizes import snap

RESOLUTION = 1 / 32   # octaves: the width within which a step counts as located
FINE_BITS = 7         # significant bits of a refined size (1/64 to 1/128 of an octave apart)
FLOOR = 0.02          # the least disagreement (relative) that counts as a step


@dataclass(frozen=True)
class Point:
    """One measured size: the median time and its confidence interval."""

    nbytes: int
    time_s: float
    ci_lo_s: float
    ci_hi_s: float

    @property
    def noise(self) -> float:
        """Half-width of the confidence interval, relative to the median."""
        return max(self.ci_hi_s - self.ci_lo_s, 0.0) / (2 * self.time_s)


@dataclass(frozen=True)
class Line:
    """T(n) = t0 + slope * (n - n0), slope >= 0, never below pure bandwidth scaling."""

    n0: float
    t0: float
    slope: float

    def __call__(self, n: float) -> float:
        return max(self.t0 + self.slope * (n - self.n0), self.t0 * min(1.0, n / self.n0))


def line_through(a: Point, b: Point, anchor: Point) -> Line:
    slope = max((b.time_s - a.time_s) / (b.nbytes - a.nbytes), 0.0)
    return Line(float(anchor.nbytes), anchor.time_s, slope)


def miss(p: Point, line: Line) -> float:
    """|log| of measured over predicted."""
    return abs(math.log(p.time_s / line(p.nbytes)))


@dataclass
class Step:
    """A flagged interval (lo, hi) of one curve, with the smooth models on both sides."""

    lo: Point
    hi: Point
    left: Line | None
    right: Line | None
    jump: float        # the smaller of the two sides' misses (|log|), the step's size
    threshold: float   # the noise level a midpoint is judged against at the sweep's ends

    @property
    def width(self) -> float:
        return math.log2(self.hi.nbytes / self.lo.nbytes)

    def located(self, resolution: float = RESOLUTION) -> bool:
        return self.width <= resolution + 1e-12

    def side(self, p: Point) -> str:
        """'left' when the midpoint ``p`` lies on the left branch (the step is above it)."""
        if self.left is not None and self.right is not None:
            return "left" if miss(p, self.left) <= miss(p, self.right) else "right"
        if self.right is not None:
            return "right" if miss(p, self.right) <= self.threshold else "left"
        return "left" if miss(p, self.left) <= self.threshold else "right"

    def as_dict(self) -> dict:
        return {"lo_bytes": self.lo.nbytes, "hi_bytes": self.hi.nbytes, "width_octaves": self.width,
                "jump": math.exp(self.jump), "lo_us": self.lo.time_s * 1e6, "hi_us": self.hi.time_s * 1e6}


def flag_steps(points: list[Point], floor: float = FLOOR) -> list[Step]:
    """The intervals between consecutive points that hold a step (see the module doc)."""
    pts = sorted(points, key=lambda p: p.nbytes)
    out = []
    for i in range(len(pts) - 1):
        a, b = pts[i], pts[i + 1]
        left = line_through(pts[i - 1], a, anchor=a) if i >= 1 else None
        right = line_through(b, pts[i + 2], anchor=b) if i + 2 < len(pts) else None
        threshold = max(floor, a.noise + b.noise)
        misses = [m for m in (miss(b, left) if left else None, miss(a, right) if right else None) if m is not None]
        if misses and min(misses) > threshold:
            out.append(Step(a, b, left, right, min(misses), threshold))
    return out


def midpoint(lo: int, hi: int, aligned: Callable[[int], int]) -> int | None:
    """An aligned size strictly inside (lo, hi) near their geometric mean; None if there is none."""
    mid = math.sqrt(lo * hi)
    for candidate in (aligned(snap(mid, FINE_BITS)), aligned(int(mid))):
        if lo < candidate < hi:
            return candidate
    return None


@dataclass
class Report:
    """What one curve's refinement did."""

    steps: list[Step] = field(default_factory=list)
    added: list[int] = field(default_factory=list)   # sizes measured by the refinement, in order
    spent_s: float = 0.0
    stopped: str = "every step located"              # or "point limit", "time budget"

    def located(self) -> int:
        return sum(s.located() for s in self.steps)


def refine(points: list[Point], measure: Callable[[int], tuple[Point, float]], aligned: Callable[[int], int], *,
           budget_s: float, max_points: int, cost: Callable[[int], float], floor: float = FLOOR,
           resolution: float = RESOLUTION, progress: Callable[[Report, Step], None] | None = None) -> Report:
    """Bisect every flagged interval of ``points`` (one curve of the sweep).

    ``measure(nbytes)`` returns the point and the seconds it took (for a size
    already on disk: the stored point and the seconds it took then).
    ``aligned(nbytes)`` rounds a size as the collective needs. The next point is
    measured only while the seconds spent plus its expected cost stay within
    ``budget_s``: ``cost(nbytes)`` (an upper bound, e.g. the dearer sweep point
    around it) until a refined point has been measured, then ``cost`` times the
    largest ratio of a refined point's time to its ``cost`` so far.
    """
    report = Report()
    queue: list[tuple[float, int, int]] = []
    for k, step in enumerate(flag_steps(points, floor)):
        report.steps.append(step)
        heapq.heappush(queue, (-step.jump * step.width, k, k))
    seq = len(report.steps)
    ratio = None
    while queue:
        _, _, k = heapq.heappop(queue)
        step = report.steps[k]
        if step.located(resolution):
            continue
        m = midpoint(step.lo.nbytes, step.hi.nbytes, aligned)
        if m is None:  # no aligned size left between them: as located as it can be
            continue
        if len(report.added) >= max_points:
            report.stopped = "point limit"
            break
        if report.spent_s + cost(m) * (1.0 if ratio is None else ratio) > budget_s:
            report.stopped = "time budget"
            break
        p, took = measure(m)
        report.added.append(m)
        report.spent_s += took
        ratio = max(ratio or 0.0, took / cost(m)) if cost(m) > 0 else ratio
        if step.side(p) == "left":
            step.lo = p
        else:
            step.hi = p
        seq += 1
        heapq.heappush(queue, (-step.jump * step.width, seq, k))
        if progress:
            progress(report, step)
    return report
