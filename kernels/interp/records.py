"""The interpreter's measurement records: a benchmark against NCCL (``python -m kernels
bench``, kind ``kernels-bench``) and a forced-configuration sweep with the machine's
ceilings (``python -m kernels bench --sweep``, kind ``interp-tune``), on which the
interpreter's cost model (``kernels.interp.model``) is fitted."""
from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, field

from calibrate.errors import UserError
from calibrate.records import Record

TIMING = ("measurement engine: CUDA graph of N calls per side, replays interleaved, CUDA events, median of replays, "
          "max over ranks; each side checked on fresh random data before timing and after its timed replays")


@dataclass
class BenchRecord(Record):
    KIND = "kernels-bench"
    VERSION = 1
    WHAT = "interpreter benchmark result"
    FIX = "write one with python -m kernels bench --out DIR"

    device: str
    nranks: int
    preset: str
    rows: list[dict]
    date: str = field(default_factory=lambda: _dt.date.today().isoformat())
    timing: str = TIMING

    @classmethod
    def from_body(cls, d: dict, origin: str) -> "BenchRecord":
        return cls(d.get("device", ""), d.get("nranks", 0), d.get("preset", ""), d["rows"], d.get("date", ""),
                   d.get("timing", TIMING))


@dataclass
class SweepRecord(Record):
    """Runs of a sweep: each ``{"sweep": name, "rows": [...], "ceilings": [...]}``; a row is a
    benchmark row (``kernels.interp.bench.measure``) with the variant, tile cap, threads and, for a
    library program, its ``algorithm`` and ``nranks`` (rows of older sweeps name a reference MSCCL
    program, ``program_file``)."""

    KIND = "interp-tune"
    VERSION = 1
    WHAT = "interpreter sweep record"
    FIX = "give reports/records/interp_tune_*.json or write one with python -m kernels bench --sweep model"

    device: str
    runs: list[dict]
    date: str = field(default_factory=lambda: _dt.date.today().isoformat())

    @classmethod
    def from_body(cls, d: dict, origin: str) -> "SweepRecord":
        return cls(d.get("device", ""), d.get("runs", []), d.get("date", ""))

    def ceiling_us(self, prefix: str, nbytes: int) -> float:
        """The first run's ceiling named ``prefix...`` at ``nbytes``, in microseconds (a ceiling that was wrong
        after timing or did not run has no time: refused)."""
        for run in self.runs:
            for c in run.get("ceilings", []):
                if str(c.get("ceiling", "")).startswith(prefix) and int(c.get("bytes", -1)) == nbytes:
                    us = float(c["us"]) if c.get("us") is not None else math.nan
                    if not (math.isfinite(us) and us > 0):
                        raise UserError(f"the interpreter sweep's ceiling {c.get('ceiling')!r} at {nbytes} bytes has no "
                                        f"time ({c.get('why') or c.get('status') or 'not measured'}): record the sweep "
                                        f"again with python -m kernels bench --sweep")
                    return us
        raise UserError(f"the interpreter sweep record has no ceiling {prefix!r} at {nbytes} bytes; "
                        f"record a sweep with python -m kernels bench --sweep, which measures it")
