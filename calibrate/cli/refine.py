"""``calibrate run --refine``: the adaptive refinement of one collective's curve
after its sweep, with its budget and progress lines (the logic is in
``calibrate.refine``).

The budget of a curve is ``--refine-budget`` times the seconds its sweep took
(points.csv), and at most ``--refine-points`` sizes. Refined sizes are timed
but not checked (``--check`` covers the sweep's sizes). A resumed run replays
the same decisions from the points on disk and measures only what is missing.
"""
from __future__ import annotations

import bisect
import math
import sys
from typing import Callable

import numpy as np

from calibrate.collectives import Collective
from calibrate.refine import RESOLUTION, Point, Report, Step, refine
from calibrate.sizes import align


def _point(nbytes: int, rec: dict) -> Point:
    return Point(nbytes, rec["median_s"], rec["ci_lo_s"], rec["ci_hi_s"])


def _size(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{int(n)}"


def refine_curve(args, say: Callable, label: str, coll: Collective, p: int, sizes: list[int], stored: dict,
                 measure_size: Callable[[int, str, bool], None]) -> dict:
    """Refine the curve of ``coll`` on group ``label`` (``p`` ranks); ``stored`` holds every point measured
    (key (group, collective, bytes)) and ``measure_size(nbytes, phase, check)`` adds one. Returns the
    record of what it did (refine.json)."""
    aligned_sizes = sorted({align(coll, n, p, args.dtype)[0] for n in sizes})
    recs = [(n, stored[(label, coll.value, n)]) for n in aligned_sizes]
    walls = [r["wall_s"] for _, r in recs if r["wall_s"] is not None]
    typical = float(np.median(walls)) if walls else 0.0
    sweep_s = sum(r["wall_s"] if r["wall_s"] is not None else typical for _, r in recs)
    budget_s = args.refine_budget * sweep_s

    def measure(nbytes: int) -> tuple[Point, float]:
        key = (label, coll.value, nbytes)
        if key not in stored:
            measure_size(nbytes, "refine", False)
        rec = stored[key]
        return _point(nbytes, rec), rec["wall_s"] if rec["wall_s"] is not None else typical

    def progress(rep: Report, step: Step) -> None:
        say(f"# refine {coll.value} {label}: point {len(rep.added)}/{args.refine_points}, "
            f"{rep.spent_s:.1f}/{budget_s:.1f} s: step x{math.exp(step.jump):.2f} in "
            f"{_size(step.lo.nbytes)}..{_size(step.hi.nbytes)} ({step.width * 32:.2g}/32 octave)", file=sys.stderr)

    def aligned(n: int) -> int:
        return align(coll, n, p, args.dtype)[0]

    say(f"# refine {coll.value} {label}: sweep took {sweep_s:.1f} s; budget {budget_s:.1f} s "
        f"and {args.refine_points} points", file=sys.stderr)
    sweep_walls = [(n, r["wall_s"] if r["wall_s"] is not None else typical) for n, r in recs]

    def cost(nbytes: int) -> float:
        """The dearer of the two sweep sizes around ``nbytes`` (which were checked as well: an upper bound)."""
        k = bisect.bisect_left([n for n, _ in sweep_walls], nbytes)
        return max(w for _, w in sweep_walls[max(k - 1, 0):k + 1])

    report = refine([_point(n, r) for n, r in recs], measure, aligned, budget_s=budget_s,
                    max_points=args.refine_points, cost=cost, floor=args.refine_tol, progress=progress)
    for s in report.steps:
        where = "located" if s.located(RESOLUTION) else "not located"
        say(f"#   step x{math.exp(s.jump):.2f} between {_size(s.lo.nbytes)} and {_size(s.hi.nbytes)} "
            f"({s.width * 32:.2g}/32 octave, {where})", file=sys.stderr)
    share = f"{100 * report.spent_s / sweep_s:.0f}%" if sweep_s > 0 else "-"
    say(f"# refine {coll.value} {label}: {len(report.added)} refined points (limit {args.refine_points}), "
        f"{report.spent_s:.1f} s = {share} of the sweep's {sweep_s:.1f} s; {report.located()}/{len(report.steps)} "
        f"steps located within 1/32 octave; {report.stopped}", file=sys.stderr)
    return {"sweep_points": len(recs), "sweep_s": sweep_s, "budget_s": budget_s, "refined_points": len(report.added),
            "refine_s": report.spent_s, "stopped": report.stopped, "located": report.located(),
            "steps": [dict(s.as_dict(), located=s.located(RESOLUTION)) for s in report.steps]}
