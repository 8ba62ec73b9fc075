"""A profile's ``residuals`` section: how far the step model missed on this machine, per apply path, from
plans run by ``autotune tune`` (measured step over predicted step), so that the next search starts from
corrected prices (``autotune.plan.hostpace.corrected``).

    "residuals": {"version": 1, "source": "autotune tune, 2026-11-28T18:10, 4 x NVIDIA H200",
                  "model": "2026-11-30",
                  "paths": {"ddp": 1.12, "fully_shard": 1.31, "dtensor": 2.4, "none": 1.02, "pipeline": 1.07},
                  "runs": [{"strategy": "...", "path": "ddp", "predicted_s": .., "measured_s": ..}, ...]}

A factor is the median over the runs of its path of measured / predicted (the prediction before any earlier
correction): 1.12 prices that path's plans 12% slower. The paths are apply's (``HOST_PATHS``) for single-stage
plans, and "pipeline" for pipelined ones (their stages' paths together); a plan that recomputes has its own key,
the path and the recomputation ("fully_shard/full", ``key``), and where that key has no runs it takes its path's
factor (``lookup``): on 2 x H200 (2026-11-30) the plans recomputing every block ran 1.7-6.6% slower than priced
(FSDP, DTensor, tensor and pipelined plans), those without within 1.3% but one (-5.2%), so one factor a path would
mis-correct both kinds. ``model``: the revision of the step model whose predictions the factors divide
(``autotune``'s ``STEP_MODEL``; "" in a section written before it was recorded): a factor corrects only the
predictions it was measured against.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from calibrate.compute import HOST_PATHS
from calibrate.errors import UserError

VERSION = 1
PIPELINE = "pipeline"  # a pipelined plan's residual (its stages' paths together)
PATHS = (*HOST_PATHS, PIPELINE)
RECOMPUTED = ("selective", "full")  # the recomputations with keys of their own (``key``)
LIMITS = (1e-3, 1e4)  # sanity bounds (a CPU run priced by a GPU profile misses by 10-100x)


@dataclass(frozen=True)
class Residuals:
    paths: dict  # PATHS path -> measured / predicted
    source: str = ""
    runs: tuple = ()
    model: str = ""  # the step model's revision the predictions came from

    def lookup(self, key: str) -> float | None:
        """The factor of ``key`` (``key``), else of its path alone (a recomputing plan on a path measured only
        without recomputation), else None."""
        found = self.paths.get(key, self.paths.get(key.split("/")[0]))
        return None if found is None else float(found)

    def to_dict(self) -> dict:
        return {"version": VERSION, "source": self.source, "model": self.model, "paths": dict(self.paths),
                "runs": [dict(r) for r in self.runs]}

    @classmethod
    def from_dict(cls, d, origin: str = "profile") -> "Residuals":
        fix = "re-run torchrun ... -m autotune tune, or drop the section"
        paths = d.get("paths") if isinstance(d, dict) else None
        if not isinstance(d, dict) or d.get("version") != VERSION or not isinstance(paths, dict) or any(
                not valid_key(k) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or not LIMITS[0] <= v <= LIMITS[1] for k, v in paths.items()):
            raise UserError(f"{origin}: residuals section is not version {VERSION} with paths of {', '.join(PATHS)} "
                            f"(each alone or /{' or /'.join(RECOMPUTED)}) -> measured / predicted between "
                            f"{LIMITS[0]} and {LIMITS[1]}: {fix}")
        runs, model = d.get("runs", []), d.get("model", "")
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            raise UserError(f"{origin}: residuals runs is not a list of objects: {fix}")
        if not isinstance(model, str):
            raise UserError(f"{origin}: residuals model is not a revision string: {fix}")
        return cls({k: float(v) for k, v in paths.items()}, str(d.get("source", "")), tuple(runs), model)


def key(path: str, recompute: str) -> str:
    """The residual key of a plan on ``path`` recomputing as ``recompute`` ("none", or one of ``RECOMPUTED``)."""
    return path if recompute == "none" else f"{path}/{recompute}"


def valid_key(k) -> bool:
    path, _, mode = k.partition("/") if isinstance(k, str) else ("", "", "")
    return path in PATHS and (k == path or mode in RECOMPUTED)


def fitted(runs: list[dict], source: str, before: "Residuals | None" = None, model: str = "") -> Residuals:
    """The factors of ``runs`` (each: path, its ``key``; predicted_s before correction, measured_s) against the
    step model of revision ``model``, per key the median; the keys no run measured keep ``before``'s where it is of
    the same revision."""
    by: dict = {}
    for r in runs:
        if r.get("measured_s") and r.get("predicted_s"):
            by.setdefault(r["path"], []).append(r["measured_s"] / r["predicted_s"])
    paths = dict(before.paths) if before is not None and before.model == model else {}
    for path, xs in by.items():
        xs = sorted(xs)
        mid = len(xs) // 2
        paths[path] = min(max(xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2, LIMITS[0]), LIMITS[1])
    return Residuals(paths, source, tuple(runs), model)
