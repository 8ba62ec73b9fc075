"""Validate the model offline on a recorded tuning run, and fit its parameters.

``python -m autotune schedule --rescore RUN/schedule.json``: the measured rows of
every band predicted again with the current interpreter model, printed next to
the measurement with the error, and Spearman per band: the recorded ranking
(whatever model that run used), the current model alone, and the current model
with the per-protocol correction fitted on the other bands (leave-one-band-out).
Nothing is measured: the figures are a re-scoring of the recorded measurements.

``python -m autotune schedule --fit-model reports/records/interp_tune_*.json``:
the interpreter model's parameters fitted on an interpreter sweep record
(interp_model.fit), printed as the JSON of kernels/interp/fitted/interp_model.json.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from calibrate.profile import Profile
from kernels.interp import pack
from kernels.interp.preset import Preset

from kernels.interp import model as interp_model
from autotune.schedule.choose import correlations
from autotune.schedule.model import Model
from autotune.schedule.result import TuneResult
from autotune.schedule.space import build_candidate

ONE_HOP_CEILING = "one-shot LL allreduce"   # kernels.interp.sweep ceiling names (prefixes)
GRAPH_NODE_CEILING = "graph kernel node"


def fmt(x: float | None, spec: str = ".2f") -> str:
    """``x`` formatted by ``spec``, "-" for none."""
    return "-" if x is None else format(x, spec)


def rescore(path: str, profile: Profile, preset: Preset, params: interp_model.ModelParams) -> str:
    """The report of re-predicting a recorded run's measured rows (model_us and predicted_us of the
    rows are replaced; the correction is refitted leave-one-band-out)."""
    run = TuneResult.load(path)
    lines = [f"re-scoring of {path}: measured {run.date} on {run.device or 'no device'} ({run.ranks} ranks); "
             f"model parameters: {params.provenance.get('source', 'given')}; profile {profile.name}"]
    for res in run.collectives:
        built = {k: build_candidate(c, run.ranks, run.nodes) for k, c in res.candidates.items()}
        model = Model(profile, res.collective, run.ranks, run.nodes, run.gpus_per_node, pack.DTYPES[run.dtype],
                      preset.fifo, params)
        recorded = {b.rep: b.spearman for b in res.bands}
        for b in res.bands:
            for r in b.measured_rows():
                r.model_us = r.predicted_us = model.model_seconds(built[r.key], b.rep) * 1e6
        correlations(res.bands, {k: c.protocol for k, c in res.candidates.items()})
        lines.append(f"{res.collective}:")
        for b in res.bands:  # correlations() ranked predicted_us, which is model_us here
            rows = sorted(b.measured_rows(), key=lambda r: r.measured_us)
            lines.append(f"  band {b.rep} B: {len(rows)} measured; Spearman recorded {fmt(recorded[b.rep])}, "
                         f"model {fmt(b.spearman)}, model + correction (leave-one-band-out) "
                         f"{fmt(b.spearman_corrected)}")
            for r in rows:
                err = 100 * (r.model_us / r.measured_us - 1)
                lines.append(f"    {r.key:<48} split {r.split:>3}  model {r.model_us:10.2f} us  "
                             f"measured {r.measured_us:10.2f} us  error {err:+6.1f}%")
        lines.append(f"  Spearman per band, recorded: {[fmt(recorded[b.rep]) for b in res.bands]}")
        lines.append(f"  Spearman per band, model:    {[fmt(b.spearman) for b in res.bands]}")
        lines.append(f"  Spearman per band, model + correction (leave-one-band-out): "
                     f"{[fmt(b.spearman_corrected) for b in res.bands]}")
    lines.append("nothing was measured: a re-scoring of the recorded measurements")
    return "\n".join(lines)


def fit_record(path: str, profile: Profile, preset: Preset, esize: int = 4,
               reference_dir: Path | None = None) -> interp_model.ModelParams:
    """The interpreter model's parameters fitted on an interpreter sweep record (float32 rows; rows of
    reference MSCCL programs, in older records, only with their ``reference_dir``)."""
    record = interp_model.load_tune_record(path)
    samples = interp_model.tune_samples(record, preset.threads, reference_dir)
    one_hop, node = record.ceiling_us(ONE_HOP_CEILING, 1024), record.ceiling_us(GRAPH_NODE_CEILING, 0)
    provenance = {"source": path, "measured": f"{record.date or '?'} on {record.device or '?'}, "
                                              f"python -m kernels bench --sweep (reports/records/interp.md)",
                  "fitted": _dt.date.today().isoformat(),
                  "command": f"python -m autotune schedule --fit-model {path}",
                  "samples": len(samples), "profile": profile.name,
                  "hop_us": f"one-block LL allreduce of 1 KiB {one_hop:.2f} us less an empty graph node "
                            f"{node:.2f} us (ceilings of the same record)"}
    if any(interp_model.hops(s.program) > 1 for s in samples):
        provenance["hop_us"] = "fitted with the other parameters on the record's multi-hop programs"
    return interp_model.fit(samples, preset.fifo, esize, interp_model.Links.from_profile(profile),
                            round(one_hop - node, 2), provenance)


def fit_report(path: str, profile: Profile, preset: Preset) -> str:
    return json.dumps(fit_record(path, profile, preset).to_json(), indent=1)
