"""The host's cost of a training step on each of apply's paths, fitted from executed steps.

Where kernels take less time than the host takes to issue them (a small model, or DTensor's per-op
dispatch on any model), a step lasts as long as the host's issue: the step model's device time is then not
what runs. ``python -m autotune execute`` records each step's host issue time (``measured.host_issue_s``)
and the path apply placed the plan by (``apply_path``: "dtensor", "ddp", "fully_shard", "none"). Per path,
over runs of one model family at two or more depths and two or more micro-batch counts (host-bound: the
kernels shorter than their issue), the least-squares fit

    host issue per step = a + n (m h_pass + h_step)

with n the layer occurrences of the model's graph (``len(graph.chain)``) and m its micro-batches gives
``h_pass`` (seconds per layer occurrence and micro-batch: its forward and backward issued) and ``h_step``
(per layer occurrence and step: its optimizer update issued); ``a`` (the step's fixed cost) is left out of
the figures. Negative coefficients are noise: the fit is then repeated without them (``h_step`` first).
``fit_profile`` writes them into a profile's compute section (``host_s``), which
``autotune.pipeline.stage`` reads as a floor under each stage's time on its path.

    torchrun --nproc-per-node 4 -m autotune execute plan.json --which "baseline:data parallel" --out d2
    torchrun ... execute plan.json --which "baseline:data parallel" --apply-path dtensor --out t2
    python -m autotune execute --fit-host d2 d8 t2 t8 ... --profile profile.json --out profile-host.json
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from calibrate.compute import HOST_PATHS
from calibrate.errors import UserError
from calibrate.profile import Profile

from autotune.execute.result import load_records
from autotune.plan.typed import ModelSpec


@dataclass(frozen=True)
class HostPoint:
    path: str
    occurrences: int  # layer occurrences of the model's graph
    micro_batches: int
    host_s: float  # the host's issue time of a step (median over the timed steps)
    device: str
    family: tuple  # the model's fields other than its depth


@dataclass(frozen=True)
class HostFit:
    path: str
    per_pass_s: float  # per layer occurrence and micro-batch
    per_step_s: float  # per layer occurrence and step
    fixed_s: float  # per step
    points: tuple[HostPoint, ...]
    worst: float  # the largest relative gap of a point from the fit

    def predict(self, occurrences: int, micro_batches: int) -> float:
        return self.fixed_s + occurrences * (micro_batches * self.per_pass_s + self.per_step_s)


def points(folders) -> list[HostPoint]:
    """The host points of the execute results in ``folders`` (those with a host issue time and a path)."""
    out = []
    for folder in folders:
        for rec in load_records(Path(folder)):
            host = (rec.get("measured") or {}).get("host_issue_s")
            path = rec.get("apply_path")
            if rec.get("error") or host is None or path not in HOST_PATHS:
                continue
            cfg = dict(rec.get("model") or {})
            graph = ModelSpec(str(cfg.get("kind")), {k: v for k, v in cfg.items() if k != "kind"}).graph()
            family = tuple(sorted((k, v) for k, v in cfg.items() if k not in ("layers", "micro_batch", "name", "source", "description")
                                  and isinstance(v, (int, float, str, bool))))
            out.append(HostPoint(path, len(graph.chain), int(rec["micro_batches"]), float(host), str(rec.get("device")),
                                 (cfg.get("kind"),) + family))
    return out


def fit(pts: list[HostPoint]) -> HostFit:
    """The least-squares fit of one path's points (module doc); a UserError where they cannot separate the
    per-pass cost from the rest (fewer than two depths or two micro-batch counts, several families)."""
    path = pts[0].path
    if len({p.family for p in pts}) > 1 or len({p.device for p in pts}) > 1:
        raise UserError(f"host fit of the {path} path: its runs are of several models or devices; fit one model "
                        f"family on one device (vary only --layers and the micro-batch)")
    if len({p.occurrences for p in pts}) < 2 or len({p.micro_batches for p in pts}) < 2:
        raise UserError(f"host fit of the {path} path: {len(pts)} run(s) at depths "
                        f"{sorted({p.occurrences for p in pts})} (layer occurrences) and micro-batch counts "
                        f"{sorted({p.micro_batches for p in pts})}: run two depths and two micro-batch counts")
    y = np.array([p.host_s for p in pts])
    columns = {"fixed": [1.0] * len(pts), "pass": [p.occurrences * p.micro_batches for p in pts],
               "step": [p.occurrences for p in pts]}
    keep = ["fixed", "pass", "step"]
    while True:
        x = np.array([columns[k] for k in keep], dtype=float).T
        coef = dict(zip(keep, np.linalg.lstsq(x, y, rcond=None)[0]))
        negative = [k for k in ("step", "fixed") if k in keep and coef[k] < 0]
        if not negative or coef["pass"] < 0:
            break
        keep.remove(negative[0])
    if coef["pass"] <= 0 or not math.isfinite(coef["pass"]):
        raise UserError(f"host fit of the {path} path: the host time does not grow with the layers and micro-batches "
                        f"({[(p.occurrences, p.micro_batches, round(p.host_s, 6)) for p in pts]}): the runs are not "
                        f"host-bound, or too noisy; run a smaller model, more steps")
    f = HostFit(path, float(coef["pass"]), float(coef.get("step", 0.0)), float(coef.get("fixed", 0.0)), tuple(pts), 0.0)
    worst = max(abs(f.predict(p.occurrences, p.micro_batches) / p.host_s - 1) for p in pts)
    return replace(f, worst=worst)


def fits(folders) -> tuple[list[HostFit], list[str]]:
    """(the fits of the paths whose runs fit, why the others did not); a UserError where none fits."""
    pts = points(folders)
    if not pts:
        raise UserError(f"no execute result with a host issue time and an apply path in {', '.join(map(str, folders))}: "
                        f"run python -m autotune execute --out DIR first")
    found, failed = [], []
    for path in HOST_PATHS:
        mine = [p for p in pts if p.path == path]
        if mine:
            try:
                found.append(fit(mine))
            except UserError as e:
                failed.append(str(e))
    if not found:
        raise UserError("; ".join(failed))
    return found, failed


def fit_profile(profile: Profile, found: list[HostFit], source: str) -> Profile:
    """``profile`` with the fitted paths' host figures in its compute section (other paths kept)."""
    if profile.compute is None:
        raise UserError(f"profile {profile.name!r} has no compute section for the host figures: run python -m "
                        f"calibrate compute first")
    host = dict(profile.compute.host_s)
    sources = dict(profile.compute.sources)
    for f in found:
        host[f.path] = (f.per_pass_s, f.per_step_s)
        sources[f"host_s.{f.path}"] = source
    return replace(profile, compute=replace(profile.compute, host_s=host, sources=sources))


def table(found: list[HostFit]) -> str:
    rows = [("path", "runs", "us / layer / micro-batch", "us / layer / step", "fixed ms", "worst gap")]
    rows += [(f.path, str(len(f.points)), f"{f.per_pass_s * 1e6:.1f}", f"{f.per_step_s * 1e6:.1f}",
              f"{f.fixed_s * 1e3:.2f}", f"{f.worst * 100:.1f}%") for f in found]
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)) for r in rows)
