"""``python -m calibrate fit <results dirs...> -o profile.json``: fit piecewise
alpha-beta models per tier, collective and group size, validate them on held-out
sizes, and write a versioned profile."""
from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from calibrate.cli import command_parser, finite_float
from calibrate.collectives import Collective
from calibrate.errors import UserError
from calibrate.measure.stats import rel_err_pct
from calibrate.fit import METHODS, fit_curve, fit_quality_problem, holdout, implied_busbw, measured_steps, switches
from calibrate.outputs import check_output_path
from calibrate.profile import CollectiveModel, Profile
from calibrate.results import load_results
from calibrate.validation import compare, summarize

METHOD_TEXT = {
    "segments": "piecewise non-negative least squares on relative error (AutoDDL §3, Table 2 ring coefficients), "
                "segments chosen by BIC, medians per size; segment boundaries at the steps of the measured curve "
                "(located by calibrate run --refine where it ran)",
    "interpolate": "one alpha-beta segment (AutoDDL §3, Table 2 ring coefficients) between each two neighbouring "
                   "measured sizes, through both medians (non-negative least squares on relative error where that "
                   "would need a negative alpha or beta); the steps of the curve are where calibrate run --refine "
                   "bracketed them (switches: within 1/32 octave where located)",
}
# AutoDDL-style accuracy targets for graph-timed data (issue 3)
TARGET_MEDIAN, TARGET_MAX = 0.05, 0.15
FLAT_TOLERANCE = 1.25


def build_parser():
    p = command_parser("python -m calibrate fit",
                description="Fit alpha-beta models to calibration results and write a profile.")
    p.add_argument("results", nargs="+", help="results directories written by python -m calibrate run")
    p.add_argument("-o", "--out", default="profile.json", help="profile JSON to write. Default profile.json")
    p.add_argument("--name", default=None, help="profile name. Default: the output file's stem")
    p.add_argument("--method", default="interpolate", choices=METHODS,
                   help="interpolate: one alpha-beta segment between each two neighbouring measured sizes (follows "
                        "every step the sweep and the refinement measured); segments: at most --max-segments "
                        "segments chosen by BIC (smooths the noise of neighbouring sizes). Default interpolate")
    p.add_argument("--max-segments", type=int, default=6, help="most segments per curve (--method segments). Default 6")
    p.add_argument("--min-points", type=int, default=3, help="fewest sizes per segment. Default 3")
    p.add_argument("--link-peak", type=finite_float, default=None,
                   help="the link's peak bandwidth per direction in GB/s, shown beside the fitted beta")
    p.add_argument("--validation", nargs="+", default=[], metavar="DIR",
                   help="results directories of sizes drawn at random (python -m calibrate validate --random), "
                        "not used by the fit: the fitted profile is judged on them and the errors go into its "
                        "provenance")
    p.add_argument("--compute-from", default=None, metavar="PROFILE",
                   help="carry the compute and device sections (python -m calibrate compute) of this profile, a "
                        "name or a JSON file, into the fitted one (a refit of an embedded profile keeps its compute figures)")
    p.add_argument("--note", default=None, help="a line for the profile's provenance (where and how it was measured)")
    p.add_argument("--quiet", action="store_true", help="print only the summary table")
    return p


def combine(runs: list[tuple[dict, pd.DataFrame]]) -> tuple[pd.DataFrame, dict]:
    """One table of medians per (tier, collective, ranks, bytes) from compatible runs."""
    modes = sorted({m["config"]["mode"] for m, _ in runs})
    if len(modes) > 1:
        raise UserError(f"the results mix timing modes ({', '.join(modes)}): fit each mode into its own profile")
    dtypes = sorted({m["config"]["dtype"] for m, _ in runs})
    if len(dtypes) > 1:
        raise UserError(f"the results mix dtypes ({', '.join(dtypes)}): fit each dtype into its own profile")
    frames = [st.assign(groups_per_node=groups_per_node(meta, st)) for meta, st in runs]
    df = pd.concat(frames, ignore_index=True)
    bad = df[~np.isfinite(df["median_s"]) | (df["median_s"] <= 0)]
    if not bad.empty:
        r = bad.iloc[0]
        raise UserError(f"non-finite or non-positive time for {r['collective']} at {r['bytes']} B: measure it again")
    mixed = df.groupby(["tier", "collective", "ranks"])["groups_per_node"].nunique()
    if (mixed > 1).any():
        tier, coll, p = mixed[mixed > 1].index[0]
        raise UserError(f"the results measure {tier}/{coll} on groups of {p} ranks with different numbers of groups "
                        f"crossing each node's network at once (runs of different ranks per node): fit each into its "
                        f"own profile")
    med = df.groupby(["tier", "collective", "ranks", "bytes"], as_index=False).agg(
        median_s=("median_s", "median"), ci_lo_s=("ci_lo_s", "min"), ci_hi_s=("ci_hi_s", "max"),
        groups_per_node=("groups_per_node", "first"))
    return med, {"mode": modes[0], "dtype": dtypes[0]}


def groups_per_node(meta: dict, stats: pd.DataFrame) -> pd.Series:
    """Per stats row, how many groups crossed each node's network at once: a run measures every group of
    a kind at once, and a group of ``ranks`` on ``nodes`` nodes leaves each node's other ranks to that many
    other groups (the inter groups: one per rank of a node; the world: one). 1 inside a node."""
    per_node = meta["config"]["world_size"] // max(int(meta.get("nodes", 1)), 1)
    crossing = stats["nodes"] > 1
    shared = (per_node * stats["nodes"] // stats["ranks"]).clip(lower=1)
    return shared.where(crossing, 1).astype(int)


def describe(runs) -> tuple[dict, dict]:
    hardware, software = {}, {}
    for meta, _ in runs:
        for r in meta.get("ranks") or []:
            if "gpu" in r:
                hardware.setdefault("gpu", r["gpu"])
            for k in ("nccl", "cupy", "cuda_runtime", "driver", "mpi", "mpi4py"):
                if k in r:
                    software.setdefault(k, r[k])
        hardware["nodes"] = max(hardware.get("nodes", 0), meta.get("nodes", 1))
        hardware["ranks"] = max(hardware.get("ranks", 0), meta["config"]["world_size"])
    return hardware, software


def fit_profile(runs, name: str, max_segments: int, min_points: int,
                method: str = "segments") -> tuple[Profile, list[dict], list[dict]]:
    med, cfg = combine(runs)
    hardware, software = describe(runs)
    tiers: dict = {}
    summary, heldout_rows = [], []
    for (tier, coll_name, p), g in med.groupby(["tier", "collective", "ranks"]):
        coll, p = Collective.parse(coll_name), int(p)
        n, t = g["bytes"].to_numpy(float), g["median_s"].to_numpy(float)
        segs = fit_curve(method, coll, p, n, t, max_segments, min_points)
        val = holdout(coll, p, n, t, max_segments, min_points, method)
        steps = switches(coll, p, segs) if method == "segments" else \
            measured_steps(n, t, g["ci_lo_s"].to_numpy(float), g["ci_hi_s"].to_numpy(float))
        model = CollectiveModel(segs, [[float(a), float(b)] for a, b in zip(n, t)], val.as_dict() if val else {},
                                method, steps, int(g["groups_per_node"].iloc[0]))
        tiers.setdefault(tier, {}).setdefault(coll.value, {})[str(p)] = model
        row = {"tier": tier, "collective": coll.value, "p": p, "sizes": len(n), "segments": len(segs),
               "steps_located": f"{sum(s['located'] for s in steps)}/{len(steps)}",
               "alpha_us": segs[0].alpha * 1e6, "busbw_GBps": implied_busbw(coll, p, segs) / 1e9,
               "heldout_median_%": val.median_abs_rel_err * 100 if val else float("nan"),
               "heldout_max_%": val.max_abs_rel_err * 100 if val else float("nan"),
               "r2_log": val.r2_log if val else float("nan")}
        summary.append(row)
        for nb, meas, pred in (val.rows if val else []):
            heldout_rows.append({"tier": tier, "collective": coll.value, "p": p, "bytes": int(nb),
                                 "measured_us": meas * 1e6, "predicted_us": pred * 1e6,
                                 "error_%": rel_err_pct(pred, meas)})
    provenance = {
        "kind": "measured",
        "fitted": _dt.datetime.now().isoformat(timespec="seconds"),
        "runs": [{"path": str(m.get("_path", "")), "created": m.get("created"), "command": m.get("command"),
                  "hosts": m["config"].get("hosts")} for m, _ in runs],
        "method": METHOD_TEXT[method],
    }
    prof = Profile(name=name, provenance=provenance, hardware=hardware, software=software,
                   timing_mode=cfg["mode"], tiers=tiers)
    return prof, summary, heldout_rows


def flatness_warnings(summary: list[dict]) -> list[str]:
    """Implied bus bandwidth should not depend on p on a flat fabric."""
    out = []
    df = pd.DataFrame(summary)
    for (tier, coll), g in df.groupby(["tier", "collective"]):
        if len(g) < 2:
            continue
        bw = g["busbw_GBps"]
        if bw.max() / max(bw.min(), 1e-12) > FLAT_TOLERANCE:
            out.append(f"{tier}/{coll}: implied busbw varies across p "
                       f"({', '.join(f'p={p}: {b:.1f}' for p, b in zip(g['p'], bw))} GB/s): "
                       f"the fabric is not flat or a size regime is missing")
    return out


def judge_random(prof: Profile, paths: list[str], quiet: bool) -> dict:
    """The fitted profile against sizes drawn at random (measured apart from the fit), per collective."""
    runs = load_results(paths)
    for path, (meta, _) in zip(paths, runs):
        if meta["config"].get("mode") != prof.timing_mode:
            raise UserError(f"{path!r} was timed in {meta['config'].get('mode')} mode, the fit in "
                            f"{prof.timing_mode} mode: validate each mode against its own profile")
    table = compare(prof, pd.concat([st for _, st in runs], ignore_index=True))
    summary = summarize(table)
    if not quiet:
        print("# random sizes (not fitted): prediction next to measurement")
        print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        print()
    print("# error at the random sizes per tier, collective and group size")
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    return {"method": "sizes drawn at random (log-uniform, python -m calibrate validate --random), "
                      "measured apart from the fit",
            "runs": [{"path": str(p), "created": m.get("created"), "command": m.get("command")}
                     for p, (m, _) in zip(paths, runs)],
            "summary": summary.to_dict(orient="records")}


def quality_warnings(summary: list[dict]) -> list[str]:
    """Fits below ``calibrate.fit.MIN_R2`` (held-out log-time r2) or above ``MAX_HELDOUT_ERR`` (held-out max)."""
    out = []
    for row in summary:
        problem = fit_quality_problem(row["r2_log"], row["heldout_max_%"] / 100)
        if problem:
            out.append(f"poor fit for {row['tier']}/{row['collective']} at p={row['p']}: {problem}; the timings "
                       f"are noisy: measure again with more --iters and --reps, at most one rank per core, "
                       f"or in graph mode")
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_segments < 1:
        raise UserError(f"--max-segments must be >= 1, got {args.max_segments}")
    if args.min_points < 2:
        raise UserError(f"--min-points must be >= 2 (a segment fits alpha and beta), got {args.min_points}")
    if args.link_peak is not None and args.link_peak <= 0:
        raise UserError(f"--link-peak must be a bandwidth above 0 GB/s, got {args.link_peak}")
    check_output_path(args.out, "profile")
    measured = Profile.load(args.compute_from) if args.compute_from else None  # loaded before the fit: a bad file fails first
    runs = load_results(args.results)
    for (meta, _), path in zip(runs, args.results):
        meta["_path"] = path
    name = args.name or Path(args.out).stem
    prof, summary, heldout_rows = fit_profile(runs, name, args.max_segments, args.min_points, args.method)
    pd.set_option("display.width", 200)
    if not args.quiet and heldout_rows:
        print("# held-out sizes: prediction next to measurement")
        print(pd.DataFrame(heldout_rows).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        print()
    table = pd.DataFrame(summary)
    print("# fit per tier, collective and group size (held-out errors: fitted on every other size)")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    for w in flatness_warnings(summary) + quality_warnings(summary):
        print(f"warning: {w}", file=sys.stderr)
    if prof.timing_mode == "graph":
        miss = table[(table["heldout_median_%"] > TARGET_MEDIAN * 100) | (table["heldout_max_%"] > TARGET_MAX * 100)]
        print(f"# targets (graph mode): held-out median <= {TARGET_MEDIAN:.0%}, max <= {TARGET_MAX:.0%}: "
              + ("all met" if miss.empty else f"missed by {', '.join(miss['collective'] + '@p=' + miss['p'].astype(str))}"))
    if args.validation:
        prof.provenance["random_validation"] = judge_random(prof, args.validation, args.quiet)
    if args.note:
        prof.provenance["note"] = args.note
    if args.compute_from:
        prof.compute, prof.device = measured.compute, measured.device
    if args.link_peak:
        prof.hardware["link_peak_GBps"] = args.link_peak
    path = prof.save(args.out)
    print(f"# profile {name!r} written to {path}", file=sys.stderr)
    return 0
