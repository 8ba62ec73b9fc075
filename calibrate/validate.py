"""``python -m calibrate validate --profile P <results dirs...>``: a profile's
prediction next to each measurement, with the error, and a summary per
collective and tier (e.g. a 2-GPU profile judged on 4- and 8-GPU runs)."""
from __future__ import annotations


import numpy as np
import pandas as pd

from calibrate.cli import command_parser
from calibrate.profile import DEFAULT_PROFILE, Group, Profile
from calibrate.results import load_results
from calibrate.sizes import parse_size


def build_parser():
    p = command_parser("python -m calibrate validate",
                description="Compare a profile's predictions with calibration measurements.")
    p.add_argument("results", nargs="+", help="results directories written by python -m calibrate run")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"profile name or JSON file. Default {DEFAULT_PROFILE}")
    p.add_argument("--min-bytes", default="0", help="judge only sizes from this one up (e.g. 1M)")
    p.add_argument("--summary-only", action="store_true", help="print only the summary")
    return p


def compare(profile: Profile, stats: pd.DataFrame, min_bytes: int = 0) -> pd.DataFrame:
    rows = []
    for _, r in stats[stats["bytes"] >= min_bytes].iterrows():
        pred = profile.time(r["collective"], float(r["bytes"]), Group(int(r["ranks"]), int(r["nodes"])))
        rows.append({"tier": r["tier"], "collective": r["collective"], "p": int(r["ranks"]),
                     "bytes": int(r["bytes"]), "measured_us": r["median_s"] * 1e6,
                     "predicted_us": pred * 1e6, "error_%": (pred - r["median_s"]) / r["median_s"] * 100})
    return pd.DataFrame(rows)


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    g = table.assign(abs_err=table["error_%"].abs()).groupby(["tier", "collective", "p"])
    return g["abs_err"].agg(points="count", median_abs_err_pct="median", max_abs_err_pct="max").reset_index()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    profile = Profile.load(args.profile)
    stats = pd.concat([st for _, st in load_results(args.results)], ignore_index=True)
    table = compare(profile, stats, parse_size(args.min_bytes) if args.min_bytes != "0" else 0)
    fmt = lambda v: f"{v:.2f}"  # noqa: E731
    if not args.summary_only:
        print(table.to_string(index=False, float_format=fmt))
        print()
    print(f"# profile {profile.name!r} ({profile.provenance.get('kind')}) against the measurements")
    print(summarize(table).to_string(index=False, float_format=fmt))
    if np.isfinite(table["error_%"]).all():
        return 0
    return 1
