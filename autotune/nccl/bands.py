"""Size bands: the sizes to tune at and the half-open byte ranges each one stands for.

Sizes are nccl-tests' "size" (the whole buffer). Band i is represented by size
s_i and covers [lo_i, hi_i): the boundaries are the geometric means of
neighbouring sizes (rounded up) (a choice measured at s_i is taken to hold halfway, on a log
scale, to the next size); the first band starts at 0 and the last has no upper
bound (hi = 0), so the tuned table covers every size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from calibrate.errors import OptionError
from calibrate.sizes import format_size, parse_size, sweep

DEFAULT_SIZES = "1K:1G:4"


@dataclass(frozen=True)
class Band:
    rep: int        # the size measured and simulated for this band
    lo: int         # first size covered
    hi: int         # first size not covered; 0: no upper bound

    def covers(self, nbytes: int) -> bool:
        return nbytes >= self.lo and (self.hi == 0 or nbytes < self.hi)

    @property
    def label(self) -> str:
        return f"[{format_size(self.lo)}, {format_size(self.hi) if self.hi else 'inf'})"


def parse_sizes(text: str) -> list[int]:
    """``"1K:1G:4"`` (min:max:factor, a geometric sweep) or ``"1K,64K,1M"`` (a list)."""
    text = text.strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 3:
            raise OptionError("sizes", f"{text!r}: write min:max:factor (e.g. 1K:1G:4) or a list (e.g. 1K,1M,1G)")
        try:
            factor = float(parts[2])
        except ValueError:
            raise OptionError("sizes", f"{text!r}: the factor {parts[2]!r} is not a number; write e.g. 1K:1G:4") \
                from None
        if not (math.isfinite(factor) and factor > 1):
            raise OptionError("sizes", f"{text!r}: the factor {parts[2]!r} must be a number above 1 (each size that "
                                       f"many times the one before); write e.g. 1K:1G:4")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        if lo > hi:
            raise OptionError("sizes", f"{text!r}: the smallest size comes first; write e.g. {parts[1]}:{parts[0]}:"
                            f"{parts[2]}")
        sizes = sweep(lo, hi, factor)
    else:
        sizes = sorted({parse_size(t) for t in text.split(",") if t.strip()})
    if not sizes:
        raise OptionError("sizes", f"{text!r} names no size; write e.g. 1K:1G:4")
    if sizes[0] <= 0:
        raise OptionError("sizes", f"{text!r}: sizes must be positive")
    return sizes


def bands_for(sizes: list[int]) -> list[Band]:
    sizes = sorted(set(sizes))
    # the ceiling of the geometric mean, kept in (a, b] so that each band holds its own size
    edges = [min(b, max(a + 1, math.isqrt(a * b - 1) + 1)) for a, b in zip(sizes, sizes[1:])]
    los = [0] + edges
    his = edges + [0]
    return [Band(s, lo, hi) for s, lo, hi in zip(sizes, los, his)]
