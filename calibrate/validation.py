"""Judging a profile against measurements: its prediction beside each measured
size with the error and the summary per collective and tier (the random sizes that ``calibrate validate --random``
measures, off every sweep's grid, are drawn by ``calibrate.measure.heldout.random_sizes``)."""
from __future__ import annotations

import pandas as pd

from calibrate.measure.stats import rel_err_pct
from calibrate.profile import Group, Profile


def compare(profile: Profile, stats: pd.DataFrame, min_bytes: int = 0) -> pd.DataFrame:
    rows = []
    for _, r in stats[stats["bytes"] >= min_bytes].iterrows():
        pred = profile.time(r["collective"], float(r["bytes"]), Group(int(r["ranks"]), int(r["nodes"])))
        rows.append({"tier": r["tier"], "collective": r["collective"], "p": int(r["ranks"]),
                     "bytes": int(r["bytes"]), "measured_us": r["median_s"] * 1e6,
                     "predicted_us": pred * 1e6, "error_%": rel_err_pct(pred, r["median_s"])})
    return pd.DataFrame(rows)


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    g = table.assign(abs_err=table["error_%"].abs()).groupby(["tier", "collective", "p"])
    return g["abs_err"].agg(points="count", median_abs_err_pct="median", max_abs_err_pct="max").reset_index()


def measured_on(meta: dict) -> str:
    """What a results directory was measured on, in words: its GPUs, or host CPUs (backend mpi)."""
    gpus = sorted({r["gpu"] for r in meta.get("ranks", []) if isinstance(r, dict) and isinstance(r.get("gpu"), str)})
    backend = meta.get("config", {}).get("backend", "")
    return ", ".join(gpus) if gpus else f"host CPUs (backend {backend or 'mpi'})"


def fairness_warnings(profile: Profile, runs: list[tuple[dict, pd.DataFrame]]) -> list[str]:
    """Where judging ``profile`` on ``runs`` (meta, stats) compares unlike things: another device, another
    timing mode, group sizes or message sizes the profile never measured (predicted by extrapolation)."""
    out = []
    device = profile.hardware.get("gpu") if isinstance(profile.hardware.get("gpu"), str) else None
    for meta, stats in runs:
        where = measured_on(meta)
        if device and device not in where:
            out.append(f"profile {profile.name!r} is of {device}; these measurements are of {where}: the comparison is "
                       f"of different hardware")
        mode = meta.get("config", {}).get("mode")
        if profile.timing_mode and mode and mode != profile.timing_mode:
            out.append(f"profile {profile.name!r} was timed in {profile.timing_mode} mode, these measurements in "
                       f"{mode} mode: the comparison includes the difference between the modes")
    seen = set()
    for _, stats in runs:
        for (tier, coll, p), g in stats.groupby(["tier", "collective", "ranks"]):
            by_p = profile.tiers.get(tier, {}).get(coll, {})
            if by_p and str(int(p)) not in by_p and (tier, coll, p) not in seen:
                seen.add((tier, coll, p))
                near = profile.model(coll, Group(int(p), int(g["nodes"].iloc[0])))[0]
                have = sorted(int(k) for k in by_p if by_p[k] is near)
                out.append(f"{tier} {coll} on {int(p)} ranks: the profile has no model for that group size; "
                           f"predicted from its {have[0] if have else '?'}-rank model (extrapolated)")
            top = max((pt[0] for m in by_p.values() for pt in m.points), default=0)
            if top and g["bytes"].max() > top * 2 and (tier, coll, "bytes") not in seen:
                seen.add((tier, coll, "bytes"))
                out.append(f"{tier} {coll}: sizes up to {int(g['bytes'].max())} B measured; the profile's largest "
                           f"measured size is {int(top)} B (beyond it, extrapolated)")
    return out
