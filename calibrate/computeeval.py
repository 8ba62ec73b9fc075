"""Confirmatory evaluation of the compute model: held-out shapes, the record, its summary.

Development (``python -m calibrate compute``) measures a fixed grid of shapes (its
``development_grid``) and the model interpolates between them. The shapes evaluation
measures are declared first (``python -m calibrate compute declare``): drawn at random
off that grid, written with the grid into a ``calibrate.measure.heldout.Declaration``
(``extra``) whose SHA-256 is stored beside it, before the development run that the
evaluation judges. ``python -m calibrate compute evaluate`` then measures, in a fresh
process, each held-out shape's matmul, causal SDPA (forward, backward) and memory-bound
layer pieces (``calibrate.layers``, forward and backward) through the measurement
engine, against the profile's prediction for it. A row is one figure; the one relative
error is ``calibrate.measure.stats.rel_err``: (predicted - measured) / measured,
positive where the model is too slow. A figure that could not be measured, or that the
model cannot predict, is a row with its reason, never left out. This module is pure
Python (the measuring is ``calibrate.cli.compute_evaluate``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from calibrate.errors import OptionError, UserError
from calibrate.measure import heldout, stats
from calibrate.records import Record

ITEMS = ("matmul", "sdpa", "layer")
SDPA_HEADS = ((8, 8), (8, 1), (16, 16), (16, 4), (24, 24), (24, 8), (32, 32), (32, 8), (48, 48), (48, 8),
              (64, 64), (64, 8))
HEAD_DIMS = (64, 128)
TUNER = "compute model"


@dataclass(frozen=True)
class Grid:
    """The shapes development measures: matmul (m, k, n); SDPA (batch, heads, kv_heads, sequence,
    head_dim) per element size; layer pieces (tokens, hidden)."""
    matmul: tuple[tuple[int, int, int], ...]
    sdpa: tuple[tuple[int, int, int, int, int], ...]
    layers: tuple[tuple[int, int], ...]

    def to_dict(self) -> dict:
        return {"matmul": [list(x) for x in self.matmul], "sdpa": [list(x) for x in self.sdpa],
                "layers": [list(x) for x in self.layers]}


def _log_uniform(rng, lo: int, hi: int, unit: int) -> int:
    first, last = math.ceil(lo / unit) * unit, hi // unit * unit
    if first > last:
        raise OptionError("unit", f"{unit}: no multiple of it lies between {lo} and {hi}: lower it or widen the range")
    return int(min(max(round(math.exp(rng.uniform(math.log(first), math.log(last))) / unit) * unit, first), last))


def _draw(count: int, what: str, draw_one, taken: set) -> list[list[int]]:
    picked: dict[tuple, None] = {}
    for _ in range(1000 * count):
        x = draw_one()
        if x not in taken:
            picked[x] = None
        if len(picked) == count:
            return [list(x) for x in picked]
    raise OptionError("count", f"{count}: that many {what} shapes off the development grid cannot be drawn from "
                               f"these ranges: widen them or hold out fewer")


def draw_shapes(grid: Grid, seed: int, count: int, matmul_range: tuple[int, int], seq_range: tuple[int, int],
                tokens: int, layers: list[tuple[int, int]], unit: int = 128) -> dict:
    """``count`` matmul and ``count`` SDPA shapes at random (seed ``seed``), none on ``grid``: matmul
    dimensions log-uniform in ``matmul_range``, multiples of ``unit``; SDPA sequences log-uniform in
    ``seq_range`` (multiples of 64), heads from ``SDPA_HEADS``, batch ``tokens`` // sequence; and the
    layer sizes given (tokens, hidden), none the grid's."""
    if count < 1:
        raise OptionError("count", f"must be at least 1 (shapes held out of each), got {count}")
    on_grid = [list(x) for x in layers if tuple(x) in set(grid.layers)]
    if on_grid:
        raise OptionError("layers", f"{on_grid}: development measures these sizes: hold out other (tokens, hidden)")
    rng = np.random.default_rng([seed, 0])
    matmul = _draw(count, "matmul", lambda: tuple(_log_uniform(rng, *matmul_range, unit) for _ in range(3)),
                   set(grid.matmul))

    def sdpa_one():
        s = _log_uniform(rng, *seq_range, 64)
        h, kv = SDPA_HEADS[int(rng.integers(len(SDPA_HEADS)))]
        return max(tokens // s, 1), h, kv, s, HEAD_DIMS[int(rng.integers(len(HEAD_DIMS)))]

    sdpa = _draw(count, "SDPA", sdpa_one, set(grid.sdpa))
    return {"matmul": matmul, "sdpa": sdpa, "layers": [list(x) for x in layers]}


def declare(grid: Grid, shapes: dict, how: str, declared: str) -> heldout.Declaration:
    """The declaration of ``shapes`` (``draw_shapes``) with the development grid they avoid."""
    return heldout.Declaration(TUNER, {}, {}, how, declared, {"shapes": shapes, "development_grid": grid.to_dict()})


def shapes_of(dec: heldout.Declaration, grid: Grid, origin: str) -> dict:
    """The held-out shapes of ``dec``, checked against today's development ``grid`` (development may have
    grown since the declaration: a shape it now measures is no longer held out)."""
    if dec.tuner != TUNER or "shapes" not in dec.extra:
        raise UserError(f"{origin} declares held-out items of {dec.tuner!r}, not the compute model's shapes: "
                        f"declare them with python -m calibrate compute declare")
    shapes = dec.extra["shapes"]
    seen = [(k, x) for k, g in (("matmul", grid.matmul), ("sdpa", grid.sdpa), ("layers", grid.layers))
            for x in shapes.get(k, []) if tuple(x) in set(g)]
    if seen:
        raise UserError(f"{origin}: held-out shapes {seen} are on today's development grid: declare new ones "
                        f"(python -m calibrate compute declare) and measure development again")
    return shapes


@dataclass
class HeldoutRecord(Record):
    KIND: ClassVar[str] = "calibrate.compute-heldout"
    VERSION: ClassVar[int] = 1
    WHAT: ClassVar[str] = "compute model held-out declaration"
    FIX: ClassVar[str] = "write one with python -m calibrate compute declare"

    command: str
    commit: str
    heldout: dict

    @classmethod
    def from_body(cls, d: dict, origin: str) -> "HeldoutRecord":
        rec = super().from_body(d, origin)
        heldout.Declaration.from_dict(rec.heldout, origin)   # the hash checked
        return rec

    @property
    def declaration(self) -> heldout.Declaration:
        return heldout.Declaration.from_dict(self.heldout, "the held-out declaration")


@dataclass
class Row:
    item: str                   # matmul | sdpa | layer
    shape: str                  # "m x k x n", "b h kv s d", "kind @ tokens x hidden"
    part: str                   # forward | backward
    predicted_s: float | None
    measured_s: float | None
    status: str                 # ok, or why there is no figure (an arm's status, "no prediction")
    reason: str = ""
    ci_lo_s: float | None = None
    ci_hi_s: float | None = None

    @property
    def rel_err(self) -> float | None:
        return stats.rel_err(self.predicted_s, self.measured_s) if self.status == "ok" else None


@dataclass
class EvaluateRecord(Record):
    KIND: ClassVar[str] = "calibrate.compute-evaluate"
    VERSION: ClassVar[int] = 1
    WHAT: ClassVar[str] = "compute model evaluation"
    FIX: ClassVar[str] = "write one with python -m calibrate compute evaluate"
    LISTS: ClassVar[dict] = {"rows": Row}

    date: str
    command: str
    commit: str
    device: str
    torch: str
    profile: str                # the profile evaluated
    profile_source: str         # its compute section's source (the development run)
    dtype: str
    heldout: dict               # the declaration (hash checked)
    timing: str                 # the engine's options, as text
    rows: list[Row] = field(default_factory=list)
    basis: str = "evaluation"

    @classmethod
    def from_body(cls, d: dict, origin: str) -> "EvaluateRecord":
        rec = super().from_body(d, origin)
        heldout.Declaration.from_dict(rec.heldout, origin)   # the hash checked
        return rec


def summary(rows: list[Row]) -> dict:
    """Per item and part: rows, measured, the median signed and absolute relative error, the worst
    absolute one, Spearman and Kendall of predicted against measured, and the rows without a figure."""
    out = {}
    for item in ITEMS:
        for part in ("forward", "backward"):
            mine = [r for r in rows if r.item == item and r.part == part]
            if not mine:
                continue
            errs = [r.rel_err for r in mine if r.rel_err is not None]
            ok = [r for r in mine if r.rel_err is not None]
            out[f"{item} {part}"] = {
                "rows": len(mine), "measured": len(ok),
                "median_err": stats.median(errs) if errs else None,
                "median_abs_err": stats.median(abs(e) for e in errs) if errs else None,
                "worst_abs_err": max((abs(e) for e in errs), default=None),
                "spearman": stats.spearman([r.predicted_s for r in ok], [r.measured_s for r in ok]),
                "kendall": stats.kendall([r.predicted_s for r in ok], [r.measured_s for r in ok]),
                "missing": [f"{r.shape}: {r.status}" + (f" ({r.reason})" if r.reason else "")
                            for r in mine if r.rel_err is None]}
    return out


def pct(x: float | None, sign: str = "+") -> str:
    """A relative error as a percentage ("-" for none); ``sign`` "" for an absolute one."""
    return "-" if x is None else f"{x * 100:{sign}.1f}%"
