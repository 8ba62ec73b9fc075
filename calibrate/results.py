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
(group, collective, size) already in stats.csv. A size counts once its stats.csv
row is on disk: its samples are written first, and on resume a torn last line
(a kill or a full disk in mid-write) is dropped, and so are samples and points of
a size that has no stats.csv row, so that measuring it again duplicates nothing.
meta.json and refine.json are replaced whole (``write_atomic``). One writer at a
time: ``prepare`` locks the directory (``calibrate.lock``) until ``close``.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from calibrate.collectives import Collective
from calibrate.errors import OptionError, UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.lock import DirLock
from calibrate.outputs import write_atomic
from calibrate.profile import TIERS
from calibrate.records import check_header

KIND = "calibration"
VERSION = 1
SAMPLE_FIELDS = ["group", "tier", "ranks", "nodes", "collective", "mode", "dtype", "bytes", "count", "rep", "time_s"]
STAT_FIELDS = ["group", "tier", "ranks", "nodes", "collective", "mode", "dtype", "bytes", "count", "n",
               "median_s", "min_s", "max_s", "p95_s", "ci_lo_s", "ci_hi_s", "algbw_GBps", "busbw_GBps", "wrong"]
POINT_FIELDS = ["group", "collective", "bytes", "phase", "wall_s"]
# configuration keys that must agree for --resume
RESUME_KEYS = ("backend", "mode", "dtype", "iters", "warmup", "reps", "min_batch_s", "world_size", "hosts", "sizes",
               "collectives", "groups")
# what a key missing from an older directory's meta.json meant
RESUME_DEFAULTS = {"min_batch_s": 0.0}


FIX = "run python -m calibrate run --resume on it to repair it, or measure again"
NUMERIC_STATS = ("ranks", "nodes", "bytes", "count", "n", "median_s", "min_s", "max_s", "p95_s", "ci_lo_s", "ci_hi_s")


@dataclass
class ResultsDir:
    path: Path
    lock: DirLock = field(init=False, repr=False)

    def __post_init__(self):
        self.path = Path(self.path)
        self.lock = DirLock(self.path, "results directory")

    @property
    def meta_path(self) -> Path:
        return self.path / "meta.json"

    def prepare(self, meta: dict, resume: bool) -> set[tuple]:
        """Create or reopen the directory and lock it (until ``close``); return the keys already measured."""
        if resume and not self.meta_path.is_file():
            raise OptionError("resume", f"{str(self.path)!r} holds no calibration to continue (no meta.json): "
                                        f"drop {{resume}} to start one there, or give the directory to continue")
        if self.path.exists() and not self.path.is_dir():
            raise OptionError("out", f"{str(self.path)!r} is a file, not a results directory: choose another")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=self.path)  # unique: runs may share the dir
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise OptionError("out", f"{str(self.path)!r}: cannot write the results directory there "
                                     f"({e.strerror}): choose another") from None
        self.lock.acquire()
        try:
            return self._reopen(meta, resume)
        except BaseException:
            self.lock.release()
            raise

    def close(self) -> None:
        """Unlock the directory."""
        self.lock.release()

    def _reopen(self, meta: dict, resume: bool) -> set[tuple]:
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
        self._repair(self.path / "stats.csv", STAT_FIELDS)
        done = self.done()
        for name, fields in (("samples.csv", SAMPLE_FIELDS), ("points.csv", POINT_FIELDS)):
            self._repair(self.path / name, fields, done)
        return done

    def write_meta(self, meta: dict) -> None:
        try:
            text = json.dumps(meta, indent=1, default=str, allow_nan=False) + "\n"
        except ValueError:
            raise UserError("the calibration settings hold a value that is not a finite number: give finite "
                            "options") from None
        write_atomic(self.meta_path, text, "results meta.json")

    def _repair(self, path: Path, fields: list[str], done: set[tuple] | None = None) -> None:
        """Drop torn lines (and, given the sizes ``done``, rows of sizes not in stats.csv): replaced whole."""
        if not path.exists() or path.stat().st_size == 0:
            write_atomic(path, ",".join(fields) + "\r\n", "results CSV")
            return
        try:
            lines = path.read_text().splitlines(keepends=True)
        except (OSError, ValueError) as e:
            raise UserError(f"{str(path)!r} is unreadable ({getattr(e, 'strerror', None) or 'not text'}): "
                            f"the results directory is damaged; measure again into a new one") from None
        good = [ln for ln in lines if ln.endswith("\n") and ln.count(",") == len(fields) - 1]
        if done is not None and good:
            cols = good[0].rstrip("\r\n").split(",")
            if {"group", "collective", "bytes"} <= set(cols):
                ig, ic, ib = cols.index("group"), cols.index("collective"), cols.index("bytes")
                good = good[:1] + [ln for ln in good[1:] if _key(ln.rstrip("\r\n").split(","), ig, ic, ib) in done]
        if len(good) != len(lines):
            write_atomic(path, "".join(good), "results CSV")

    def read_meta(self) -> dict:
        try:
            meta = json.loads(self.meta_path.read_bytes())
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) else "not valid JSON"
            raise UserError(f"{str(self.meta_path)!r} is unreadable ({why}): it is not a calibration results "
                            f"directory; give one written by python -m calibrate run") from None
        check_header(meta, KIND, VERSION, "calibration results directory", "measure again with "
                     "python -m calibrate run", repr(str(self.path)))
        return check_meta(meta, str(self.meta_path))

    def done(self) -> set[tuple]:
        if not (self.path / "stats.csv").exists():
            return set()
        df = self._read_csv("stats.csv", STAT_FIELDS)
        return {(g, c, int(b)) for g, c, b in zip(df["group"], df["collective"], df["bytes"])}

    def _read_csv(self, name: str, fields: list[str]) -> pd.DataFrame:
        """A CSV of this directory with its columns checked; one error naming it otherwise."""
        path = self.path / name
        if not path.is_file():
            raise UserError(f"{str(path)!r} is missing or not a file: {FIX}")
        try:
            df = pd.read_csv(io.StringIO(path.read_text()))
        except pd.errors.EmptyDataError:
            raise UserError(f"{str(path)!r} is empty: {FIX}") from None
        except UnicodeDecodeError:
            raise UserError(f"{str(path)!r} is not text (binary content): {FIX}") from None
        except OSError as e:
            raise UserError(f"cannot read {str(path)!r} ({e.strerror}): {FIX}") from None
        except (ValueError, pd.errors.ParserError) as e:
            raise UserError(f"{str(path)!r} is not a readable CSV ({str(e).splitlines()[0][:80]}): {FIX}") from None
        missing = [f for f in fields if f not in df.columns]
        if missing:
            raise UserError(f"{str(path)!r} lacks the columns {', '.join(missing[:4])}: it is not a {name} written "
                            f"by python -m calibrate run; {FIX}")
        numeric = [f for f in fields if f in NUMERIC_STATS or f in ("rep", "time_s", "wall_s")]
        for f in numeric:
            values = pd.to_numeric(df[f], errors="coerce")
            bad = values.isna() & df[f].notna()
            if bad.any():
                raise UserError(f"{str(path)!r} row {int(bad.idxmax()) + 2}: {f} is {df[f][bad.idxmax()]!r}, not a "
                                f"number: {FIX}")
            df[f] = values
        if "bytes" in df.columns and df["bytes"].notna().any() and (df["bytes"].dropna() <= 0).any():
            row = int((df["bytes"] <= 0).idxmax())
            raise UserError(f"{str(path)!r} row {row + 2}: bytes must be positive, got {df['bytes'][row]!r}: {FIX}")
        for f in numeric:
            col = df[f].dropna()
            if not col.map(math.isfinite).all():
                row = int((~df[f].map(lambda v: math.isfinite(v) or math.isnan(v))).idxmax())
                raise UserError(f"{str(path)!r} row {row + 2}: {f} is {df[f][row]!r}, not a finite number: {FIX}")
        return df

    def measured(self) -> dict[tuple, dict]:
        """(group, collective, bytes) -> median_s, ci_lo_s, ci_hi_s and wall_s (None where points.csv
        has no row: a directory written before it existed, or a kill between the two writes)."""
        if not (self.path / "stats.csv").exists():
            return {}
        st = self._read_csv("stats.csv", STAT_FIELDS)
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
        data = read_json(path, "refinement record", FIX) if path.exists() else {}
        if not isinstance(data, dict):
            raise UserError(f"{str(path)!r} is not a refinement record (not a JSON object): {FIX}")
        data[f"{group}/{collective}"] = record
        write_json(path, data, "refinement record")

    def points(self) -> pd.DataFrame:
        if not (self.path / "points.csv").exists():
            return pd.DataFrame(columns=POINT_FIELDS)
        return self._read_csv("points.csv", POINT_FIELDS)

    def append(self, samples: list[dict], stat: dict, point: dict | None = None) -> None:
        """Write one size's samples, then its statistics row (the resume marker), then why and
        how long it was measured, to disk."""
        for name, fields, rows in (("samples.csv", SAMPLE_FIELDS, samples), ("stats.csv", STAT_FIELDS, [stat]),
                                   ("points.csv", POINT_FIELDS, [point] if point else [])):
            text = io.StringIO()
            csv.DictWriter(text, fieldnames=fields).writerows(rows)
            try:
                with open(self.path / name, "a", newline="") as f:
                    f.write(text.getvalue())
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                raise UserError(f"cannot write {str(self.path / name)!r} ({e.strerror}): the sizes measured so "
                                f"far are kept; free space, then add --resume to continue") from None

    def stats(self) -> pd.DataFrame:
        self.read_meta()
        path = self.path / "stats.csv"
        if not path.exists():
            raise UserError(f"{str(self.path)!r} has no stats.csv: the calibration measured nothing")
        df = self._read_csv("stats.csv", STAT_FIELDS)
        torn = df[df[["bytes", "median_s"]].isna().any(axis=1)]
        if not torn.empty:
            raise UserError(f"{str(path)!r} row {int(torn.index[0]) + 2} is torn or incomplete (no bytes or "
                            f"median_s): {FIX}")
        bad = df[(df["median_s"] <= 0) | (df["n"] < 1)]
        if not bad.empty:
            raise UserError(f"{str(path)!r} row {int(bad.index[0]) + 2}: median_s and n must be positive: {FIX}")
        known = {c.value for c in Collective}
        for column, allowed in (("collective", known), ("tier", set(TIERS))):
            odd = df[~df[column].isin(allowed)]
            if not odd.empty:
                raise UserError(f"{str(path)!r} row {int(odd.index[0]) + 2}: {column} {odd[column].iloc[0]!r} is not "
                                f"one of {', '.join(sorted(allowed))}: {FIX}")
        return df

    def samples(self) -> pd.DataFrame:
        """Every sample of the sizes in stats.csv (a size whose stats row a kill cut off is left out)."""
        df = self._read_csv("samples.csv", SAMPLE_FIELDS)
        done = self.done()
        keep = [(g, c, int(b)) in done for g, c, b in zip(df["group"], df["collective"], df["bytes"].fillna(0))]
        return df[keep].reset_index(drop=True)


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
        if not rd.meta_path.is_file():
            raise UserError(f"{str(path)!r} has no meta.json: give a directory written by python -m calibrate run")
        meta = rd.read_meta()
        stats = rd.stats()
        if stats.empty:
            raise UserError(f"{str(path)!r} holds no measurements: run python -m calibrate run --resume on it")
        out.append((meta, stats))
    return out


def _key(cells: list[str], ig: int, ic: int, ib: int) -> tuple | None:
    try:
        return cells[ig], cells[ic], int(float(cells[ib]))
    except (IndexError, ValueError):
        return None


def check_meta(meta: dict, origin: str) -> dict:
    """``meta`` when its configuration has the types the readers rely on; one ``UserError`` otherwise."""
    fix = "it is damaged: measure again with python -m calibrate run"
    config = meta.get("config")
    if not isinstance(config, dict):
        raise UserError(f"{origin!r}: config is {type(config).__name__}, not an object: {fix}")
    for key, kinds in (("backend", str), ("mode", str), ("dtype", str), ("world_size", int), ("iters", int),
                       ("warmup", int), ("reps", int), ("min_batch_s", (int, float)), ("collectives", list),
                       ("groups", list), ("hosts", list), ("sizes", (list, dict))):
        if key in config and (isinstance(config[key], bool) or not isinstance(config[key], kinds)):
            raise UserError(f"{origin!r}: config/{key} is {config[key]!r}, not a {_kind_name(kinds)}: {fix}")
    if isinstance(config.get("min_batch_s"), float) and not math.isfinite(config["min_batch_s"]):
        raise UserError(f"{origin!r}: config/min_batch_s is {config['min_batch_s']!r}, not finite: {fix}")
    if isinstance(config.get("world_size"), int) and config["world_size"] < 1:
        raise UserError(f"{origin!r}: config/world_size is {config['world_size']}, not a rank count: {fix}")
    for key, kinds in (("ranks", list), ("env", dict), ("nodes", int)):
        if key in meta and (isinstance(meta[key], bool) or not isinstance(meta[key], kinds)):
            raise UserError(f"{origin!r}: {key} is {meta[key]!r:.40}, not a {_kind_name(kinds)}: {fix}")
    if isinstance(meta.get("ranks"), list) and not all(isinstance(r, dict) for r in meta["ranks"]):
        raise UserError(f"{origin!r}: ranks holds something other than per-rank objects: {fix}")
    return meta


def _kind_name(kinds) -> str:
    names = {int: "whole number", float: "number", str: "string", list: "list", dict: "object"}
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if set(kinds) == {int, float}:
        return "number"
    return " or ".join(names[k] for k in kinds)
