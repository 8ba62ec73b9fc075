"""The fit judged offline on recorded runs: refit a sweep with each fit method and compare the
prediction with the random sizes measured beside it (no GPU; seconds):

    python tests/gpu/calib_offline.py SWEEP_DIR RANDOM_DIR [--methods interpolate segments] [--worst 3]

SWEEP_DIR: a results directory of calibrate run (sweep and refined sizes: what the fit reads);
RANDOM_DIR: the random sizes of the same run (calibrate run --random) or of another one.
Prints, per method and collective, the median and the maximum error at the random sizes, below and
above 1 MiB, and the worst sizes with the measured sizes around them (prediction beside measurement),
so that a change of the fit is checked on real data before a GPU run.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from calibrate.cli.fit import fit_profile
from calibrate.fit import METHODS
from calibrate.results import load_results
from calibrate.validation import compare

SPLIT = 1 << 20


def judge(sweep_dir: str, random_dir: str, method: str, worst: int) -> tuple[list[dict], list[str]]:
    runs = load_results([sweep_dir])
    prof, _, _ = fit_profile(runs, "offline", 6, 3, method)
    measured = pd.concat([st for _, st in load_results([random_dir])], ignore_index=True)
    table = compare(prof, measured)
    table["abs"] = table["error_%"].abs()
    sweep = pd.concat([st for _, st in runs], ignore_index=True)
    rows, lines = [], []
    for coll, g in table.groupby("collective"):
        row = {"method": method, "collective": coll, "points": len(g),
               "median_%": g["abs"].median(), "max_%": g["abs"].max()}
        for name, part in (("<1MiB", g[g["bytes"] < SPLIT]), (">=1MiB", g[g["bytes"] >= SPLIT])):
            row[f"median{name}_%"] = part["abs"].median() if len(part) else np.nan
            row[f"max{name}_%"] = part["abs"].max() if len(part) else np.nan
        rows.append(row)
        known = sweep[sweep["collective"] == coll].sort_values("bytes")
        for _, r in g.nlargest(worst, "abs").iterrows():
            below = known[known["bytes"] < r["bytes"]].tail(1)
            above = known[known["bytes"] > r["bytes"]].head(1)
            around = " and ".join(f"{int(k['bytes'])} B: {k['median_s'] * 1e6:.2f} us"
                                  for k in (below.to_dict("records") + above.to_dict("records")))
            lines.append(f"{method:>11} {coll:>13} {int(r['bytes']):>10} B: measured {r['measured_us']:9.2f} us, "
                         f"predicted {r['predicted_us']:9.2f} us ({r['error_%']:+6.2f}%); measured around: {around}")
    return rows, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="results directory of the sweep (and refinement)")
    ap.add_argument("random", help="results directory of the random sizes")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="fit methods to compare")
    ap.add_argument("--worst", type=int, default=3, help="worst sizes shown per method and collective. Default 3")
    args = ap.parse_args(argv)
    rows, lines = [], []
    for method in args.methods:
        r, ln = judge(args.sweep, args.random, method, args.worst)
        rows += r
        lines += ln
    pd.set_option("display.width", 220)
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
