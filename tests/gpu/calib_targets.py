"""The targets table of part "calibrate" (tests/gpu/calib_check.sh), from what it wrote under one folder:

    python tests/gpu/calib_targets.py OUT [--profile graph=PATH --profile host=PATH]

Per timing mode and collective: sweep and refined points and seconds (points.csv), the steps the
refinement found and located (refine.json), the error of the mode's profile at the random sizes
(random-<mode>/, measured in the sweep's run, used by no fit), and where the same sizes were measured
again in a process of their own (random-separate-<mode>/), how far the two measurements of each size
differ (rerun_med_%, rerun_max_%: the floor under any model's error judged across runs). Targets
(issue 18): graph median <= 2% and max <= 5%, host median <= 3% and max <= 10%, refinement <= 30% of
the plain sweep's time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from calibrate.profile import Profile
from calibrate.results import ResultsDir, load_results
from calibrate.validation import compare, summarize

TARGETS = {"graph": (2.0, 5.0), "host": (3.0, 10.0)}
OVERHEAD = 30.0


def mode_rows(out: Path, mode: str, prof_path: Path) -> tuple[list[dict], float, float]:
    rd = ResultsDir(out / f"calib-{mode}")
    if not (rd.path / "points.csv").exists():
        print(f"{mode}: no sweep in {rd.path}")
        return [], 0.0, 0.0
    pts = rd.points()
    refine = json.loads((rd.path / "refine.json").read_text()) if (rd.path / "refine.json").exists() else {}
    errs = pd.DataFrame()
    rand = out / f"random-{mode}"
    if prof_path.exists() and (rand / "stats.csv").exists():
        stats = pd.concat([st for _, st in load_results([rand])], ignore_index=True)
        errs = summarize(compare(Profile.load(prof_path), stats)).set_index("collective")
    rerun = pd.DataFrame()
    again = out / f"random-separate-{mode}"
    if (rand / "stats.csv").exists() and (again / "stats.csv").exists():
        a, b = (pd.concat([st for _, st in load_results([d])], ignore_index=True) for d in (rand, again))
        both = a.merge(b, on=["collective", "bytes"], suffixes=("", "_again"))
        both["d"] = (both["median_s_again"] / both["median_s"] - 1).abs() * 100
        rerun = both.groupby("collective")["d"].agg(["median", "max"])
    rows, sweep_total, refine_total = [], 0.0, 0.0
    for coll, g in pts.groupby("collective", sort=False):
        sweep_s = g.loc[g["phase"] == "sweep", "wall_s"].sum()
        refine_s = g.loc[g["phase"] == "refine", "wall_s"].sum()
        sweep_total, refine_total = sweep_total + sweep_s, refine_total + refine_s
        rec = next((v for k, v in refine.items() if k.endswith("/" + coll)), {})
        med, mx = (errs.loc[coll, "median_abs_err_pct"], errs.loc[coll, "max_abs_err_pct"]) \
            if coll in errs.index else (float("nan"), float("nan"))
        tmed, tmax = TARGETS.get(mode, (float("nan"), float("nan")))
        rows.append({"mode": mode, "collective": coll, "sweep_pts": int((g["phase"] == "sweep").sum()),
                     "refined_pts": int((g["phase"] == "refine").sum()), "sweep_s": sweep_s, "refine_s": refine_s,
                     "overhead_%": 100 * refine_s / sweep_s if sweep_s else float("nan"),
                     "steps_located": f"{rec.get('located', 0)}/{len(rec.get('steps', []))}",
                     "random_pts": int(errs.loc[coll, "points"]) if coll in errs.index else 0,
                     "median_%": med, "max_%": mx,
                     "rerun_med_%": rerun.loc[coll, "median"] if coll in rerun.index else float("nan"),
                     "rerun_max_%": rerun.loc[coll, "max"] if coll in rerun.index else float("nan"),
                     "met": "yes" if med <= tmed and mx <= tmax else "NO"})
    return rows, sweep_total, refine_total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the folder part calibrate wrote (calib-<mode>/, random-<mode>/, profile-<mode>.json)")
    ap.add_argument("--profile", action="append", default=[], metavar="MODE=PATH",
                    help="judge this profile instead of OUT/profile-<mode>.json (e.g. graph=calibrate/profiles/h200-nvlink.json)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    profiles = {m: out_dir / f"profile-{m}.json" for m in TARGETS}
    for item in args.profile:
        mode, _, path = item.partition("=")
        if mode not in TARGETS or not path:
            ap.error(f"--profile {item!r}: write graph=PATH or host=PATH")
        profiles[mode] = Path(path)
    rows, lines = [], []
    for mode in TARGETS:
        r, sweep_s, refine_s = mode_rows(out_dir, mode, profiles[mode])
        rows += r
        if r:
            tmed, tmax = TARGETS[mode]
            met = sum(x["met"] == "yes" for x in r)
            share = 100 * refine_s / sweep_s if sweep_s else float("nan")
            lines.append(f"{mode}: random-size error median <= {tmed:g}% and max <= {tmax:g}%: met by {met}/{len(r)} "
                         f"collectives; refinement {refine_s:.1f} s = {share:.0f}% of the sweep's {sweep_s:.1f} s "
                         f"(target <= {OVERHEAD:g}%: {'met' if share <= OVERHEAD else 'MISSED'})")
    if not rows:
        print("no calibration results found")
        return 1
    pd.set_option("display.width", 220)
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
