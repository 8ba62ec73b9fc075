"""Held-out sizes: declared before a tuner looks at any measurement, hashed into its record,
and the only sizes its ``evaluate`` step measures.

A ``Declaration`` names the tuner, the sizes development may measure and the sizes
evaluation will (per collective, disjoint), and how they were drawn; its SHA-256 over the
canonical JSON is stored beside it. ``Declaration.from_dict`` recomputes the hash, so a
record whose held-out sizes were edited after development is refused.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np

from calibrate.collectives import Collective
from calibrate.errors import OptionError, UserError
from calibrate.sizes import snap


@dataclass(frozen=True)
class Declaration:
    tuner: str
    development: dict[str, list[int]]
    evaluation: dict[str, list[int]]
    how: str = ""              # how the evaluation sizes were drawn (seed, range)
    declared: str = ""         # UTC time of the declaration
    extra: dict = field(default_factory=dict)   # other held-out items (e.g. model shapes)

    def __post_init__(self):
        for coll, sizes in self.evaluation.items():
            both = sorted(set(sizes) & set(self.development.get(coll, [])))
            if both:
                raise OptionError("heldout", f"{coll}: sizes {both} are both development and evaluation sizes: "
                                             f"hold out sizes development does not measure")
            if not sizes:
                raise OptionError("heldout", f"{coll}: no evaluation size: declare at least one")

    def canonical(self) -> str:
        return json.dumps({"tuner": self.tuner, "development": self.development, "evaluation": self.evaluation,
                           "how": self.how, "declared": self.declared, "extra": self.extra},
                          sort_keys=True, separators=(",", ":"))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def to_dict(self) -> dict:
        return {**json.loads(self.canonical()), "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: dict, origin: str) -> "Declaration":
        try:
            dec = cls(str(d["tuner"]), {k: [int(x) for x in v] for k, v in d["development"].items()},
                      {k: [int(x) for x in v] for k, v in d["evaluation"].items()}, str(d.get("how", "")),
                      str(d.get("declared", "")), dict(d.get("extra", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{origin}: malformed held-out declaration ({e!r}): rerun the tuner's development "
                            f"step, which declares it") from None
        except UserError as e:
            raise UserError(f"{origin}: bad held-out declaration ({e.problem if isinstance(e, OptionError) else e}): "
                            f"rerun the tuner's development step") from None
        if d.get("sha256") != dec.sha256:
            raise UserError(f"{origin}: the held-out declaration does not match its hash (edited after it was "
                            f"declared): rerun the tuner's development step")
        return dec


def declare(tuner: str, development: dict[str, list[int]], lo: int, hi: int, count: int, seed: int,
            unit: int, declared: str, extra: dict | None = None) -> Declaration:
    """``count`` evaluation sizes per collective, log-uniform in [lo, hi], multiples of ``unit``, off the
    sweeps' grid and none a development size (``random_sizes``)."""
    colls = [Collective.parse(c) for c in development]
    try:
        drawn = random_sizes(colls, lo, hi, count, seed, unit)
    except UserError as e:
        raise OptionError("heldout", f"{count}: cannot draw that many sizes off the grid between {lo} and {hi} B in "
                                     f"multiples of {unit} B ({e}): widen the sizes or hold out fewer") from None
    evaluation = {c: sorted(n for n in drawn[Collective.parse(c).value] if n not in set(development[c]))
                  for c in development}
    how = f"{count} per collective, log-uniform in [{lo}, {hi}] B, multiples of {unit} B, off the grid, seed {seed}"
    return Declaration(tuner, {c: sorted(v) for c, v in development.items()}, evaluation, how, declared,
                       dict(extra or {}))


def random_sizes(colls: list[Collective], lo: int, hi: int, count: int, seed: int, unit: int) -> dict[str, list[int]]:
    """``count`` distinct sizes per collective, log-uniform in [lo, hi], multiples of ``unit`` and off the
    sweeps' grid; one random stream per collective."""
    if count < 1:
        raise OptionError("random", f"must be at least 1, got {count}")
    if unit < 1:
        raise OptionError("align", f"must be at least 1 byte, got {unit}")
    if not 0 < lo < hi:
        raise OptionError("min_bytes", f"and {{max_bytes}} must satisfy 0 < min < max for random sizes (got {lo} and {hi})")
    first, last = math.ceil(lo / unit) * unit, hi // unit * unit
    if first > last:
        raise OptionError("align", f"{unit}: no multiple of it lies between {lo} and {hi} B: lower it or widen the range")
    out = {}
    for i, c in enumerate(colls):
        rng = np.random.default_rng([seed, i])
        picked: dict[int, None] = {}
        for _ in range(1000 * count):
            x = math.exp(rng.uniform(math.log(first), math.log(last)))
            n = int(min(max(round(x / unit) * unit, first), last))
            if snap(n) != n:  # off the sweeps' grid (4 significant bits: 2^k, 1.375 * 2^k, ...)
                picked[n] = None
            if len(picked) == count:
                break
        else:
            raise OptionError("random", f"{count}: too few sizes off the sweep grid are multiples of {unit} B between "
                                       f"{lo} and {hi} B: lower it or {{align}}, or widen the range")
        out[c.value] = list(picked)  # in the order drawn: a run cut short keeps an unbiased sample
    return out
