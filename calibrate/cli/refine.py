"""``calibrate run --refine``: the adaptive refinement of a group's curves
after their sweeps, with the budget and progress lines (the logic is in
``calibrate.refine``).

The budget is ``--refine-budget`` times the seconds the sweeps of all the
group's collectives took (points.csv), shared by their steps, and at most
``--refine-points`` sizes per collective; both grow to what bracketing every
step found needs, the time up to ``--refine-cap`` times the sweeps' (and the probes inside the intervals,
``calibrate.refine``'s doc 5, take up to half of what the cap leaves). Refined sizes are timed but not
checked (``--check`` covers the sweep's sizes). A resumed run replays the same
decisions from the points on disk and measures only what is missing.
"""
from __future__ import annotations

import bisect
import math
import sys
from typing import Callable


from calibrate.collectives import Collective
from calibrate.measure import stats
from calibrate.refine import RESOLUTION, Point, Report, Step, refine_curves
from calibrate.sizes import align, odd_multiple


def _point(nbytes: int, rec: dict) -> Point:
    return Point(nbytes, rec["median_s"], rec["ci_lo_s"], rec["ci_hi_s"])


def _size(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{int(n)}"


def refine_group(args, say: Callable, label: str, colls: list[Collective], p: int, sizes: list[int], stored: dict,
                 measure_size: Callable[[Collective, int, str, bool], None], unit: int = 0) -> dict[str, dict]:
    """Refine the curves of ``colls`` on group ``label`` (``p`` ranks) under one budget; ``stored`` holds
    every point measured (key (group, collective, bytes)) and ``measure_size(coll, nbytes, phase, check)``
    adds one; with ``unit``, refined sizes are odd multiples of it (``calibrate.sizes.odd_multiple``).
    Returns, per collective, the record of what it did (refine.json)."""
    recs, walls = {}, {}
    for coll in colls:
        aligned_sizes = sorted({align(coll, n, p, args.dtype)[0] for n in sizes})
        recs[coll] = [(n, stored[(label, coll.value, n)]) for n in aligned_sizes]
        known = [r["wall_s"] for _, r in recs[coll] if r["wall_s"] is not None]
        typical = stats.median(known) if known else 0.0
        walls[coll] = [(n, r["wall_s"] if r["wall_s"] is not None else typical) for n, r in recs[coll]]
    sweep_s = {coll: sum(w for _, w in walls[coll]) for coll in colls}
    total_s = sum(sweep_s.values())
    budget_s = args.refine_budget * total_s
    cap_s = max(getattr(args, "refine_cap", args.refine_budget), args.refine_budget) * total_s

    def measure(coll: Collective, nbytes: int) -> tuple[Point, float]:
        key = (label, coll.value, nbytes)
        if key not in stored:
            measure_size(coll, nbytes, "refine", False)
        rec = stored[key]
        return _point(nbytes, rec), rec["wall_s"] if rec["wall_s"] is not None else cost(coll, nbytes)

    def cost(coll: Collective, nbytes: int) -> float:
        """The dearer of the two sweep sizes around ``nbytes`` (which were checked as well: an upper bound)."""
        pts = walls[coll]
        k = bisect.bisect_left([n for n, _ in pts], nbytes)
        return max(w for _, w in pts[max(k - 1, 0):k + 1])

    def progress(coll: Collective, rep: Report, step: Step | None, spent: float) -> None:
        what = f"probe inside the intervals at {_size(rep.probed[-1])}" if step is None else \
            f"step x{math.exp(step.jump):.2f} in {_size(step.lo.nbytes)}..{_size(step.hi.nbytes)} " \
            f"({step.width * 32:.2g}/32 octave)"
        say(f"# refine {label} {coll.value}: point {len(rep.added)}/{rep.max_points}, {spent:.1f}/"
            f"{rep.budget_s:.1f} s: {what}", file=sys.stderr)

    say(f"# refine {label}: the sweeps took {total_s:.1f} s; budget {budget_s:.1f} s shared by "
        f"{len(colls)} collectives (up to {cap_s:.1f} s as the steps found need), at least {args.refine_points} "
        f"points each", file=sys.stderr)
    reports = refine_curves({c: [_point(n, r) for n, r in recs[c]] for c in colls}, measure,
                            lambda c, n: align(c, odd_multiple(n, unit) if unit else n, p, args.dtype)[0],
                            budget_s=budget_s,
                            max_points=args.refine_points, cost=cost, floor=args.refine_tol, cap_s=cap_s,
                            progress=progress)
    out = {}
    for coll in colls:
        report = reports[coll]
        for s in report.steps:
            where = "no jump once measured: a phantom of a step beside it" if s.phantom else \
                "located" if s.width <= RESOLUTION + 1e-12 else \
                "no aligned size left inside" if s.exhausted else "not located"
            say(f"#   {coll.value}: step x{math.exp(s.jump):.2f} between {_size(s.lo.nbytes)} and "
                f"{_size(s.hi.nbytes)} ({s.width * 32:.2g}/32 octave, {where})", file=sys.stderr)
        share = f"{100 * report.spent_s / sweep_s[coll]:.0f}%" if sweep_s[coll] > 0 else "-"
        say(f"# refine {coll.value} {label}: {len(report.added)} refined points ({len(report.probed)} probes inside "
            f"the intervals; limit {report.max_points}), "
            f"{report.spent_s:.1f} s = {share} of its sweep's {sweep_s[coll]:.1f} s; {report.located()}/"
            f"{sum(not s.phantom for s in report.steps)} steps located within 1/32 octave; {report.stopped}",
            file=sys.stderr)
        out[coll.value] = {"sweep_points": len(recs[coll]), "sweep_s": sweep_s[coll], "budget_s": report.budget_s,
                           "point_limit": report.max_points,
                           "budget_shared_by": [c.value for c in colls], "group_sweep_s": total_s,
                           "refined_points": len(report.added), "probed_points": len(report.probed),
                           "refine_s": report.spent_s,
                           "stopped": report.stopped, "located": report.located(),
                           "steps": [dict(s.as_dict(), located=s.located(RESOLUTION)) for s in report.steps]}
    run_s = sum(r.spent_s for r in reports.values())
    say(f"# refine {label}: {sum(len(r.added) for r in reports.values())} refined points, {run_s:.1f} s = "
        f"{100 * run_s / total_s if total_s else 0:.0f}% of the sweeps' {total_s:.1f} s (budget "
        f"{100 * args.refine_budget:.0f}%, up to {100 * cap_s / total_s if total_s else 0:.0f}%)", file=sys.stderr)
    return out
