"""The tuner's result as versioned JSON (kind ``schedule-tune``, read by the report):
per collective and size band, every candidate's simulated, modelled and predicted time, the
measured time of those measured, NCCL's, the choice, Spearman's rank correlation
of model and measurement, and the tuned table."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.records import check_header, header

from autotune.schedule.space import Candidate

KIND = "schedule-tune"
VERSION = 1
NCCL = "nccl"


@dataclass
class Row:
    """One candidate in one band."""

    key: str
    split: int
    simulated_us: float              # the GC3 cost simulation (for reference; not used to rank)
    predicted_us: float              # what the ranking used: model_us with the input correction, if any
    selected: bool = False           # chosen for measurement
    measured_us: float | None = None
    correct: bool | None = None
    max_rel_err: float | None = None
    skipped: str = ""                # why a selected candidate was not measured
    model_us: float | None = None    # the interpreter cost model alone (absent in the first GPU run of 2026-11-22)


@dataclass
class BandResult:
    rep: int
    lo: int
    hi: int                          # 0: no upper bound
    nccl_predicted_us: float
    rows: list[Row]
    nccl_measured_us: float | None = None
    choice: str = NCCL
    spearman: float | None = None              # model as ranked vs measured
    spearman_corrected: float | None = None    # with the correction fitted on the other bands

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)

    def measured_rows(self) -> list[Row]:
        return [r for r in self.rows if r.measured_us is not None and r.correct]

    def distinct_measured(self) -> list[Row]:
        """The measured rows, one per distinct launch (``launch_signature``), the first in rank order,
        its measured time the mean over the launch's rows: candidates that differ only in a knob that
        does not act at this size (a tile cap above the slice, a block size that gives the same split)
        are one configuration measured twice, whose order is noise."""
        groups: dict[tuple, list[Row]] = {}
        for r in self.measured_rows():
            groups.setdefault(launch_signature(r), []).append(r)
        return [dataclasses.replace(g[0], measured_us=sum(r.measured_us for r in g) / len(g))
                for g in groups.values()]


def launch_signature(r: Row) -> tuple:
    """(program, protocol, CUDA blocks, the model's time): equal for rows that launch the same kernel
    with the same work division (keys are program/variant/protocol/blocks[/tile])."""
    parts = r.key.split("/")
    t = r.model_us if r.model_us is not None else r.predicted_us
    return ("/".join(parts[:3]), r.split, round(t, 6))


@dataclass
class TableEntry:
    lo: int
    hi: int                          # 0: no upper bound
    choice: str                      # a candidate key
    xml: str = ""                    # file written for it


@dataclass
class CollectiveResult:
    collective: str
    candidates: dict[str, Candidate]
    bands: list[BandResult]
    table: list[TableEntry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fixed_baseline: str = ""
    summary: dict = field(default_factory=dict)
    correction: dict = field(default_factory=dict)    # fitted on this run's measurements

    def to_dict(self) -> dict:
        d = asdict(self)
        d["candidates"] = {k: c.to_dict() for k, c in self.candidates.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CollectiveResult":
        bands = [BandResult(**{**b, "rows": [Row(**r) for r in b["rows"]]}) for b in d["bands"]]
        return cls(collective=d["collective"],
                   candidates={k: Candidate.from_dict(c) for k, c in d["candidates"].items()},
                   bands=bands, table=[TableEntry(**t) for t in d.get("table", [])],
                   notes=list(d.get("notes", [])), fixed_baseline=d.get("fixed_baseline", ""),
                   summary=dict(d.get("summary", {})), correction=dict(d.get("correction", {})))


@dataclass
class TuneResult:
    date: str
    ranks: int
    nodes: int
    gpus_per_node: int
    profile: str
    dtype: str
    space: str
    measured: bool
    not_measured_reason: str = ""
    device: str = ""
    input_correction: dict = field(default_factory=dict)
    heldout: dict = field(default_factory=dict)       # calibrate.measure.heldout: declared before measuring
    seconds: dict = field(default_factory=dict)       # model, measure, total
    outputs: dict = field(default_factory=dict)       # what was written where
    collectives: list[CollectiveResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = header(KIND, VERSION)
        d.update({k: v for k, v in asdict(self).items() if k != "collectives"})
        d["collectives"] = [c.to_dict() for c in self.collectives]
        return d

    @classmethod
    def from_dict(cls, d: dict, origin: str = "result") -> "TuneResult":
        check_header(d, KIND, VERSION, "schedule tuning result",
                     "pass the schedule.json that python -m autotune schedule wrote, or rerun it", origin)
        _check_result(d, origin)
        try:
            fields = {k: v for k, v in d.items() if k not in ("kind", "version", "collectives")}
            return cls(**fields, collectives=[CollectiveResult.from_dict(c) for c in d["collectives"]])
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise UserError(f"{origin} is malformed ({type(e).__name__}: {str(e)[:80]}); rerun the tuner") from None

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict(), "tuning result")

    @classmethod
    def load(cls, path: str | Path) -> "TuneResult":
        path = Path(path)
        if path.is_dir():
            path = path / "schedule.json"
        data = read_json(path, "tuning result", "give the tuner's output directory or its schedule.json, "
                                                 "or rerun python -m autotune schedule")
        return cls.from_dict(data, origin=str(path))


def _check_result(d: dict, origin: str) -> None:
    """The fields the readers rely on, typed and in range; one ``UserError`` naming the field otherwise."""
    fix = "pass the schedule.json that python -m autotune schedule wrote, or rerun it"

    def fail(field: str, problem: str):
        raise UserError(f"{origin}: {field} {problem}: {fix}")

    for key in ("ranks", "nodes", "gpus_per_node"):
        v = d.get(key)
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            fail(key, f"is {v!r:.40}, not a count >= 1")
    if not isinstance(d.get("measured"), bool):
        fail("measured", f"is {d.get('measured')!r:.40}, not true or false")
    colls = d.get("collectives")
    if not isinstance(colls, list) or not all(isinstance(c, dict) for c in colls):
        fail("collectives", "is not a list of objects")
    for i, c in enumerate(colls):
        for key, kind in (("collective", str), ("candidates", dict), ("bands", list), ("table", list)):
            if key in c and not isinstance(c[key], kind):
                fail(f"collectives/{i}/{key}", f"is {c[key]!r:.40}, not {'a string' if kind is str else 'an object' if kind is dict else 'a list'}")
        for j, t in enumerate(c.get("table", [])):
            lo, hi = (t.get("lo"), t.get("hi")) if isinstance(t, dict) else (None, None)
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (lo, hi)) \
                    or (hi and lo >= hi):
                fail(f"collectives/{i}/table/{j}", "is not a size range (lo, hi: bytes, 0 <= lo < hi, or hi 0 for "
                                                   "no upper bound)")
        for j, b in enumerate(c.get("bands", [])):
            rows = b.get("rows", []) if isinstance(b, dict) else None
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                fail(f"collectives/{i}/bands/{j}", "has no list of rows")
            for r in rows:
                for key, v in r.items():
                    if key.endswith("_us") and v is not None and not (
                            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                        fail(f"collectives/{i}/bands/{j}/rows/{key}", f"is {v!r}, not a finite time >= 0")
