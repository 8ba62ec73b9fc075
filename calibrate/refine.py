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
   step lies in the other half. The steps of all the run's curves share one
   time budget: the interval worth most per second is bisected next,
   whichever curve it is on: its width times its jump beyond the noise (how
   many sizes fall inside, and how much more than the noise they could be
   off), over the expected cost of its midpoint (a point at 500 MiB costs 15
   times one at 50 KiB); until each is narrower than ``resolution`` octaves
   or has no aligned size left inside, or the points or the time run out. A
   curve whose sweep was quick gets as much as its steps need, and a jump of
   a few percent waits for the large ones.
3. the budget adapts to the steps found: it is the larger of the base budget
   and the expected cost of bracketing every flagged step to ``resolution``
   (its bisections, ceil(log2(width / resolution)) + 1, times its midpoint's
   cost), up to a cap; a curve's point limit likewise grows to the
   bisections its steps need. A curve with ten steps (alltoall on 4 GPUs)
   gets ten steps' worth, not the share of one. Once the flagged steps are
   done, the curve's points (sweep and refined) are flagged again: a step
   next to another one (the lines beside it crossed it) shows only once its
   neighbour is located, and is bisected in turn.
4. in those later passes a line never reaches across a step already located (that side is left out,
   as at the ends of the sweep), and two things are caught that the first pass cannot tell from a
   smooth curve: a located interval that shows no jump once its ends are measured (a phantom: the
   line that flagged it crossed a step elsewhere, 4 x H200 reducescatter: the line through 1.4 and
   2.9 MB ran over the step at 3.3 MB and hit the sweep's 5.8 MB point, and flagged the flat
   stretch after it) is dropped from the known steps; and an interval where one side's line misses
   by more than ``ONE_SIDED`` times the noise (times how far the line reaches beyond the spacing of
   its two points: its error where extrapolated) while the other agrees (there the step is: the
   agreeing line met the far end by coincidence) is flagged and bisected like the others.
5. a step can lie where both lines agree: the curve jumps and then runs flat until the smooth line
   catches up with it (2 x H200, reducescatter: x1.16 between 1.44 and 1.62 MB, both ends of the
   interval on one line; the fit read 1.62 MB 7.6% fast). Nothing flags such a bump but a size inside
   it. So once no step is left to bisect, the widest intervals for their cost (wider than ``PROBE``
   octaves, none inside a located step) are measured at their midpoints, with at most half of what
   the cap leaves (the rest for the steps they reveal), and the points are flagged again.

Everything here is deterministic in the measured values, so a resumed run
(which gets the points already on disk back from ``measure``) replays the same
decisions and measures only what is missing.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable

from calibrate.sizes import snap

RESOLUTION = 1 / 32   # octaves: the width within which a step counts as located
FINE_BITS = 7         # significant bits of a refined size (1/64 to 1/128 of an octave apart)
FLOOR = 0.02          # the least disagreement (relative) that counts as a step
ONE_SIDED = 2.0       # a one-sided miss flags an interval (in later passes) beyond this many thresholds
NEAR = 1 / 8          # octaves: a step's interval this narrow is measured beside a power of two inside it
BESIDE = 256          # bytes: a step's sizes beside a power of two (``bisection_point``), as --size-unit 256's
PROBE = 0.25          # octaves: an interval wider than this is measured inside once no step is left (doc, 5)


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
    exhausted: bool = False  # no aligned size is left inside: as narrow as the sizes allow
    phantom: bool = False    # bisected to an interval with no jump: the lines that flagged it crossed another

    @property
    def width(self) -> float:
        return math.log2(self.hi.nbytes / self.lo.nbytes)

    def located(self, resolution: float = RESOLUTION) -> bool:
        return self.exhausted or self.width <= resolution + 1e-12

    def side(self, p: Point) -> str:
        """'left' when the midpoint ``p`` lies on the left branch (the step is above it)."""
        if self.left is not None and self.right is not None:
            return "left" if miss(p, self.left) <= miss(p, self.right) else "right"
        if self.right is not None:
            return "right" if miss(p, self.right) <= self.threshold else "left"
        return "left" if miss(p, self.left) <= self.threshold else "right"

    def as_dict(self) -> dict:
        return {"lo_bytes": self.lo.nbytes, "hi_bytes": self.hi.nbytes, "width_octaves": self.width,
                "no_size_left": self.exhausted, "phantom": self.phantom,
                "jump": math.exp(self.jump), "lo_us": self.lo.time_s * 1e6, "hi_us": self.hi.time_s * 1e6}


def flag_steps(points: list[Point], floor: float = FLOOR, known=(), one_sided: float | None = None) -> list[Step]:
    """The intervals between consecutive points that hold a step (see the module doc). ``known``: the
    (lo, hi) byte spans of steps already located: no line reaches across one. ``one_sided``: also flag
    an interval where one line misses by more than this many thresholds, times how far the line reaches
    beyond its own points' spacing (its lines reaching across no step flagged here or known)."""
    pts = sorted(points, key=lambda p: p.nbytes)

    def line(i: int, j: int, anchor: int, spans) -> Line | None:
        if i < 0 or j >= len(pts) or any(pts[i].nbytes <= lo and hi <= pts[j].nbytes for lo, hi in spans):
            return None
        return line_through(pts[i], pts[j], anchor=pts[anchor])

    def misses(i: int, spans) -> tuple[list[float], Line | None, Line | None, float]:
        a, b = pts[i], pts[i + 1]
        left, right = line(i - 1, i, i, spans), line(i + 1, i + 2, i + 1, spans)
        return ([m for m in (miss(b, left) if left else None, miss(a, right) if right else None) if m is not None],
                left, right, max(floor, a.noise + b.noise))

    out = []
    for i in range(len(pts) - 1):
        m, left, right, threshold = misses(i, known)
        if m and min(m) > threshold:
            out.append(Step(pts[i], pts[i + 1], left, right, min(m), threshold))
    if one_sided is None:
        return out
    spans = [*known, *((s.lo.nbytes, s.hi.nbytes) for s in out)]
    flagged = {s.lo.nbytes for s in out}
    for i in range(1, len(pts) - 2):
        if pts[i].nbytes in flagged:
            continue
        m, left, right, threshold = misses(i, spans)
        if not (left and right):
            continue
        # a line's error where it is extrapolated grows with the distance over its points' spacing
        width = pts[i + 1].nbytes - pts[i].nbytes
        reach = (width / (pts[i].nbytes - pts[i - 1].nbytes), width / (pts[i + 2].nbytes - pts[i + 1].nbytes))
        if any(x > one_sided * threshold * max(1.0, r) for x, r in zip(m, reach)):
            out.append(Step(pts[i], pts[i + 1], left, right, max(m), threshold))
    return sorted(out, key=lambda s: s.lo.nbytes)


def bisection_point(lo: int, hi: int, aligned: Callable[[int], int]) -> int | None:
    """Where a step's interval (lo, hi) is measured next: once it is narrower than ``NEAR`` octaves and holds a
    power of two, the aligned size ``BESIDE`` bytes below it, then the one above it; else ``midpoint``. NCCL's
    point-to-point thresholds fall on powers of two (2 x H200, 2026-11-29: sendrecv's time falls x0.89 at 256
    MiB, alltoall's x0.93 at 512 MiB; a size 0.1% below each was on the slow side): there two points bracket
    the step to a few hundred bytes, where bisection leaves it 1/32 octave wide and the fit's line across it
    wrong by up to the jump."""
    two = 1 << (hi.bit_length() - 1)   # the largest power of two up to hi
    if lo < two and math.log2(hi / lo) <= NEAR:
        for candidate in (aligned(two - BESIDE), aligned(two + BESIDE)):
            if lo < candidate < hi:
                return candidate
    return midpoint(lo, hi, aligned)


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
    probed: list[int] = field(default_factory=list)  # of them, the probes (module doc, 5)
    spent_s: float = 0.0
    stopped: str = "every step located"              # or "point limit", "time budget"
    budget_s: float = 0.0                            # the run's budget, as adapted to the steps found
    max_points: int = 0                              # this curve's point limit, as adapted

    def located(self) -> int:
        return sum(s.located() and not s.phantom for s in self.steps)


def refine(points: list[Point], measure: Callable[[int], tuple[Point, float]], aligned: Callable[[int], int], *,
           budget_s: float, max_points: int, cost: Callable[[int], float], floor: float = FLOOR,
           resolution: float = RESOLUTION, progress: Callable[[Report, Step], None] | None = None) -> Report:
    """``refine_curves`` on one curve."""
    return refine_curves({0: points}, lambda _, n: measure(n), lambda _, n: aligned(n), budget_s=budget_s,
                         max_points=max_points, cost=lambda _, n: cost(n), floor=floor, resolution=resolution,
                         progress=None if progress is None else lambda _, rep, step, __: progress(rep, step))[0]


def bisections(step: Step, resolution: float = RESOLUTION) -> int:
    """Midpoints that bracket ``step`` to ``resolution`` octaves: each about halves its width (aligned
    sizes of FINE_BITS bits: one more for the rounding)."""
    return math.ceil(math.log2(step.width / resolution) - 1e-9) + 1 if step.width > resolution else 0


def refine_curves(curves: dict[Hashable, list[Point]], measure: Callable[[Hashable, int], tuple[Point, float]],
                  aligned: Callable[[Hashable, int], int], *, budget_s: float, max_points: int,
                  cost: Callable[[Hashable, int], float], floor: float = FLOOR, resolution: float = RESOLUTION,
                  cap_s: float | None = None,
                  progress: Callable[[Hashable, Report, Step | None, float], None] | None = None
                  ) -> dict[Hashable, Report]:
    """Bisect every flagged interval of every curve (``curves``: key -> the sweep's points) under one
    time budget shared by all of them.

    ``measure(key, nbytes)`` returns the point and the seconds it took (for a size
    already on disk: the stored point and the seconds it took then);
    ``aligned(key, nbytes)`` rounds a size as the collective needs. The interval
    worth most per second over all curves is bisected next (the module doc). A
    midpoint is measured only while the seconds spent plus its
    expected cost stay within ``budget_s``: ``cost(key, nbytes)`` (an upper bound,
    e.g. the dearer sweep point around it) until a refined point of that curve
    has been measured, then ``cost`` times the largest ratio of a refined
    point's time to its ``cost`` so far on that curve; a step whose next
    midpoint does not fit is left there and the cheaper ones go on. At most
    ``max_points`` refined points per curve. ``progress(key, report, step, seconds spent by all)``
    after each point (``step`` None after a probe: its size is the report's last ``probed``).

    ``cap_s`` (default ``budget_s``: a fixed budget): the budget adapts to the steps flagged (module
    doc, 3), between ``budget_s`` and ``cap_s``, and the intervals are probed (module doc, 5); each
    report's ``budget_s`` and ``max_points`` say what was granted.
    """
    reports = {key: Report() for key in curves}

    def worth(key: Hashable, step: Step) -> float:
        """What bisecting ``step`` next is worth per second: its width times its jump beyond the noise,
        over its midpoint's expected cost (no midpoint left: first, to be marked as such)."""
        m = bisection_point(step.lo.nbytes, step.hi.nbytes, lambda n: aligned(key, n))
        excess = max(step.jump - step.threshold, 1e-3)
        return step.width * excess / max(cost(key, m), 1e-9) if m is not None else math.inf

    queue: list[tuple[float, int, Hashable, int]] = []
    known = {key: {p.nbytes: p for p in points} for key, points in curves.items()}
    seen: dict[Hashable, set] = {key: set() for key in curves}
    need = {key: 0 for key in curves}
    need_s = 0.0
    seq = 0
    passes = 0

    def flag_new() -> int:
        """Flag the intervals of every curve's points (the sweep's and the refined ones) not flagged
        before: a step hidden by its neighbour (the lines beside it crossed another step) shows once
        that one is located. Grows the budget and the point limits with the bisections they need."""
        nonlocal need_s, seq, budget_s, passes
        added = 0
        for key in curves:
            rep = reports[key]
            pts = list(known[key].values())
            later = passes > 0
            if later:   # a step whose interval shows no jump now that it is measured is a phantom
                jumps = {(s.lo.nbytes, s.hi.nbytes) for s in flag_steps(pts, floor)}
                for s in rep.steps:
                    s.phantom = s.phantom or (s.lo.nbytes, s.hi.nbytes) not in jumps
            spans = [(s.lo.nbytes, s.hi.nbytes) for s in rep.steps if not s.phantom]
            for step in flag_steps(pts, floor, spans if later else (), ONE_SIDED if later else None):
                span = (step.lo.nbytes, step.hi.nbytes)
                if span in seen[key] or any(s.lo.nbytes <= span[0] and span[1] <= s.hi.nbytes
                                            for s in rep.steps if not s.phantom):
                    continue
                seen[key].add(span)
                rep.steps.append(step)
                heapq.heappush(queue, (-worth(key, step), seq, key, len(rep.steps) - 1))
                seq += 1
                added += 1
                b = bisections(step, resolution)
                need[key] += b
                m = bisection_point(step.lo.nbytes, step.hi.nbytes, lambda n: aligned(key, n))
                need_s += b * cost(key, m if m is not None else step.hi.nbytes)
            rep.max_points = max_points if cap_s is None else max(max_points, need[key])
        budget_s = max(budget_s, min(need_s, budget_s if cap_s is None else cap_s))
        for rep in reports.values():
            rep.budget_s = budget_s
        passes += 1
        return added

    def probe() -> bool:
        """Measure the midpoint of the interval worth most per second among those wider than ``PROBE`` octaves
        and inside no located step, while the spent seconds stay within half of what the cap leaves; whether
        one was measured (module doc, 5)."""
        nonlocal need_s, budget_s, spent
        best = None
        for key in curves:
            sizes = sorted(known[key])
            located = [(s.lo.nbytes, s.hi.nbytes) for s in reports[key].steps if not s.phantom]
            for lo, hi in zip(sizes, sizes[1:]):
                m = midpoint(lo, hi, lambda n: aligned(key, n))
                if m is None or math.log2(hi / lo) <= PROBE + 1e-12 or any(a <= lo and hi <= b for a, b in located):
                    continue
                dear = cost(key, m) * ratio.get(key, 1.0)
                w = math.log2(hi / lo) / max(dear, 1e-9)
                if spent + dear <= (spent + cap_s) / 2 and (best is None or w > best[0]):
                    best = (w, key, m)
        if best is None:
            return False
        _, key, m = best
        rep = reports[key]
        p, took = measure(key, m)
        known[key][m] = p
        rep.added.append(m)
        rep.probed.append(m)
        rep.spent_s += took
        spent += took
        need_s += took
        need[key] += 1
        rep.max_points = max(rep.max_points, need[key])
        budget_s = max(budget_s, min(need_s, cap_s))
        for r in reports.values():
            r.budget_s = budget_s
        if progress:
            progress(key, rep, None, spent)
        return True

    flag_new()
    ratio: dict[Hashable, float] = {}
    spent = 0.0
    short = set()   # curves that left a step for want of time
    while queue or (cap_s is not None and (flag_new() or probe())):
        if not queue:  # a probe measured: its points are flagged on the next turn
            continue
        _, _, key, k = heapq.heappop(queue)
        rep = reports[key]
        step = rep.steps[k]
        if step.located(resolution):
            continue
        m = bisection_point(step.lo.nbytes, step.hi.nbytes, lambda n: aligned(key, n))
        if m is None:  # no aligned size left between them: as located as it can be
            step.exhausted = True
            continue
        if len(rep.added) >= rep.max_points:
            rep.stopped = "point limit"
            continue
        if spent + cost(key, m) * ratio.get(key, 1.0) > budget_s:
            short.add(key)
            continue
        p, took = measure(key, m)
        known[key][m] = p
        rep.added.append(m)
        rep.spent_s += took
        spent += took
        if cost(key, m) > 0:
            ratio[key] = max(ratio.get(key, 0.0), took / cost(key, m))
        if step.side(p) == "left":
            step.lo = p
        else:
            step.hi = p
        seq += 1
        heapq.heappush(queue, (-worth(key, step), seq, key, k))
        if progress:
            progress(key, rep, step, spent)
    for key in short:
        reports[key].stopped = "time budget"
    return reports
