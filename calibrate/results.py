"""A calibration results directory: written as it is measured, resumable.

    meta.json     kind "calibration", version (the one record header), the configuration that a
                  resume must match, hosts, rank -> host and GPU, versions,
                  NCCL_* environment, timing mode, command line
    samples.csv   every sample (one row per timed unit, max over ranks)
    stats.csv     per group, collective and size: median, min, max, p95, the
                  95% confidence interval of the median, algbw, busbw, #wrong
    refine.json   per group and collective, what ``--refine`` did: the steps it
                  found and where, points and seconds spent against the sweep's
    points.csv    per group, collective and size: why it was measured (phase
                  "sweep", "refine" or "random") and the seconds its measurement
                  took (max over ranks), which the refinement's budget and a
                  resumed refinement read

Rows are appended and flushed to disk (fsync) as soon as a size is measured, so
a crash or a kill loses at most the size in flight; ``--resume`` skips every
(group, collective, size) already in stats.csv. A torn last line (a kill in
mid-write) is dropped on resume.
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from calibrate.errors import OptionError, UserError
from calibrate.records import check_header

KIND = "calibration"
VERSION = 1
SAMPLE_FIELDS = ["group", "tier", "ranks", "nodes", "collective", "mode", "dtype", "bytes", "count", "rep", "time_s"]
STAT_FIELDS = ["group", "tier", "ranks", "nodes", "collective", "mode", "dtype", "bytes", "count", "n",
               "median_s", "min_s", "max_s", "p95_s", "ci_lo_s", "ci_hi_s", "algbw_GBps", "busbw_GBps", "wrong"]
POINT_FIELDS = ["group", "collective", "bytes", "phase", "wall_s"]
PHASES = ("sweep", "refine", "random")
# configuration keys that must agree for --resume
RESUME_KEYS = ("backend", "mode", "dtype", "iters", "warmup", "reps", "min_batch_s", "world_size", "hosts", "sizes",
               "collectives", "groups")
# what a key missing from an older directory's meta.json meant
RESUME_DEFAULTS = {"min_batch_s": 0.0}


@dataclass
class ResultsDir:
    path: Path

    @property
    def meta_path(self) -> Path:
        return self.path / "meta.json"

    def prepare(self, meta: dict, resume: bool) -> set[tuple]:
        """Create or reopen the directory; return the keys already measured."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise OptionError("out", f"{str(self.path)!r}: cannot write the results directory there "
                                     f"({e.strerror}): choose another") from None
        if self.meta_path.exists():
            old = self.read_meta()
            if not resume:
                raise OptionError("out", f"{str(self.path)!r} already holds a calibration: add {{resume}} to continue "
                                         f"it, or choose a new one")
            was = {k: old.get("config", {}).get(k, RESUME_DEFAULTS.get(k)) for k in RESUME_KEYS}
            diff = [k for k in RESUME_KEYS if was[k] != meta["config"].get(k)]
            if diff:
                k = diff[0]
                raise OptionError(
                    "resume", f"{str(self.path)!r} was measured with {k}={was[k]!r}, this run has "
                              f"{k}={meta['config'].get(k)!r}: use the same settings or a new {{out}}")
            meta["resumed_from"] = old.get("command")
        self.write_meta(meta)
        for name, fields in (("samples.csv", SAMPLE_FIELDS), ("stats.csv", STAT_FIELDS), ("points.csv", POINT_FIELDS)):
            self._repair(self.path / name, fields)
        return self.done()

    def write_meta(self, meta: dict) -> None:
        self.meta_path.write_text(json.dumps(meta, indent=1, default=str) + "\n")

    def _repair(self, path: Path, fields: list[str]) -> None:
        if not path.exists() or path.stat().st_size == 0:
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(fields)
            return
        lines = path.read_text().splitlines(keepends=True)
        good = [ln for ln in lines if ln.endswith("\n") and ln.count(",") == len(fields) - 1]
        if len(good) != len(lines):
            path.write_text("".join(good))

    def read_meta(self) -> dict:
        try:
            meta = json.loads(self.meta_path.read_bytes())
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) else "not valid JSON"
            raise UserError(f"{str(self.meta_path)!r} is unreadable ({why}): it is not a calibration results "
                            f"directory; give one written by python -m calibrate run") from None
        return check_header(meta, KIND, VERSION, "calibration results directory", "measure again with "
                            "python -m calibrate run", repr(str(self.path)))

    def done(self) -> set[tuple]:
        stats = self.path / "stats.csv"
        if not stats.exists():
            return set()
        df = pd.read_csv(stats)
        return {(g, c, int(b)) for g, c, b in zip(df["group"], df["collective"], df["bytes"])}

    def measured(self) -> dict[tuple, dict]:
        """(group, collective, bytes) -> median_s, ci_lo_s, ci_hi_s and wall_s (None where points.csv
        has no row: a directory written before it existed, or a kill between the two writes)."""
        if not (self.path / "stats.csv").exists():
            return {}
        st = pd.read_csv(self.path / "stats.csv")
        out = {(g, c, int(b)): {"median_s": float(m), "ci_lo_s": float(lo), "ci_hi_s": float(hi), "wall_s": None}
               for g, c, b, m, lo, hi in zip(st["group"], st["collective"], st["bytes"], st["median_s"],
                                             st["ci_lo_s"], st["ci_hi_s"])}
        for r in self.points().itertuples():
            key = (r.group, r.collective, int(r.bytes))
            if key in out:
                out[key]["wall_s"] = float(r.wall_s)
        return out

    def write_refine(self, group: str, collective: str, record: dict) -> None:
        path = self.path / "refine.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data[f"{group}/{collective}"] = record
        path.write_text(json.dumps(data, indent=1) + "\n")

    def points(self) -> pd.DataFrame:
        path = self.path / "points.csv"
        if not path.exists():
            return pd.DataFrame(columns=POINT_FIELDS)
        return pd.read_csv(path)

    def append(self, samples: list[dict], stat: dict, point: dict | None = None) -> None:
        """Write one size's samples, then its statistics row (the resume marker), then why and
        how long it was measured, to disk."""
        for name, fields, rows in (("samples.csv", SAMPLE_FIELDS, samples), ("stats.csv", STAT_FIELDS, [stat]),
                                   ("points.csv", POINT_FIELDS, [point] if point else [])):
            with open(self.path / name, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields)
                w.writerows(rows)
                f.flush()
                os.fsync(f.fileno())

    def stats(self) -> pd.DataFrame:
        self.read_meta()
        path = self.path / "stats.csv"
        if not path.exists():
            raise UserError(f"{str(self.path)!r} has no stats.csv: the calibration measured nothing")
        fix = "run python -m calibrate run --resume on it to repair it, or measure again"
        try:
            df = pd.read_csv(path)
        except pd.errors.EmptyDataError:
            raise UserError(f"{str(path)!r} is empty: {fix}") from None
        except (ValueError, pd.errors.ParserError) as e:
            raise UserError(f"{str(path)!r} is not a readable CSV ({str(e).splitlines()[0][:80]}): {fix}") from None
        missing = [f for f in STAT_FIELDS if f not in df.columns]
        if missing:
            raise UserError(f"{str(path)!r} lacks the columns {', '.join(missing[:4])}: it is not a stats.csv "
                            f"written by python -m calibrate run; {fix}")
        torn = df[df[["bytes", "median_s"]].isna().any(axis=1)]
        if not torn.empty:
            raise UserError(f"{str(path)!r} has a torn or incomplete row (row {int(torn.index[0]) + 1}): {fix}")
        return df

    def samples(self) -> pd.DataFrame:
        return pd.read_csv(self.path / "samples.csv")


def load_results(paths) -> list[tuple[dict, pd.DataFrame]]:
    """(meta, stats) of each results directory; clear errors for missing or empty ones."""
    out = []
    for p in paths:
        path = Path(p)
        if path.is_file():
            raise UserError(f"{str(path)!r} is a file, not a results directory: give the directory that "
                            f"python -m calibrate run wrote (with meta.json and stats.csv)")
        if not path.is_dir():
            raise UserError(f"results directory {str(path)!r} does not exist: give the directory that "
                            f"python -m calibrate run wrote")
        rd = ResultsDir(path)
        if not rd.meta_path.exists():
            raise UserError(f"{str(path)!r} has no meta.json: give a directory written by python -m calibrate run")
        meta = rd.read_meta()
        stats = rd.stats()
        if stats.empty:
            raise UserError(f"{str(path)!r} holds no measurements: run python -m calibrate run --resume on it")
        out.append((meta, stats))
    return out
