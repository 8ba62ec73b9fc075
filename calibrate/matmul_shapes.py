"""Matmul times by shape and operand layout, where a flops axis is not enough.

Two matmuls of the same flops can differ by 15% on one GPU (H200, bf16, 2026-11-23:
8192 x 4096 x 16384 ran at 675-700 TFLOP/s, the 8192^3 square of nearly the same flops
at 776), and a layer's backward runs its two matmuls in other layouts than its forward.
So ``python -m calibrate compute`` also times a grid of shapes (m, k, n), powers of two,
in the three layouts a linear layer runs (``LAYOUTS``), back to back as a training step
runs them, and a shape's time is read off the grid:

    efficiency e = 2 m k n / seconds, interpolated trilinearly in log2 m, log2 k, log2 n
    on log e between the eight grid points around the shape (exact on the grid)

A shape outside the grid, or whose eight neighbours were not all measured (the grid skips
its largest corner), has no figure here (``None``): the caller falls back to the flops band.
"""
from __future__ import annotations

import bisect
import math

from calibrate.errors import UserError

LAYOUTS = ("nn", "nt", "tn")  # a @ b (forward); a @ b^T (input gradient); a^T @ b (weight gradient)
GRID_M = (512, 1024, 2048, 4096, 8192, 16384)
GRID_KN = (512, 1024, 2048, 4096, 8192, 16384, 32768)
MAX_MKN = 2**42  # largest m k n timed (8.8 TFLOP, about 12 ms on an H200 in bf16)


def grid() -> list[tuple[int, int, int]]:
    return [(m, k, n) for m in GRID_M for k in GRID_KN for n in GRID_KN if m * k * n <= MAX_MKN]


class ShapeTable:
    """Measured (m, k, n) -> seconds per layout; ``seconds`` interpolates between them."""

    def __init__(self, layouts: dict[str, dict[tuple[int, int, int], float]]):
        self.layouts = layouts
        self._axes = {lay: tuple(sorted({s[i] for s in pts}) for i in range(3)) for lay, pts in layouts.items()}

    def seconds(self, m: int, k: int, n: int, layout: str = "nn") -> float | None:
        pts = self.layouts.get(layout)
        if not pts or min(m, k, n) <= 0:
            return None
        if (m, k, n) in pts:
            return pts[(m, k, n)]
        around = []  # per axis: [(grid value, weight), ...]
        for v, axis in zip((m, k, n), self._axes[layout]):
            if v < axis[0] or v > axis[-1]:
                return None
            i = bisect.bisect_left(axis, v)
            if axis[i] == v:
                around.append([(v, 1.0)])
                continue
            lo, hi = axis[i - 1], axis[i]
            w = math.log(v / lo) / math.log(hi / lo)
            around.append([(lo, 1.0 - w), (hi, w)])
        log_eff = 0.0
        for a, wa in around[0]:
            for b, wb in around[1]:
                for c, wc in around[2]:
                    t = pts.get((a, b, c))
                    if t is None:
                        return None
                    log_eff += wa * wb * wc * math.log(2.0 * a * b * c / t)
        return 2.0 * m * k * n / math.exp(log_eff)

    def to_dict(self) -> dict:
        return {lay: [[m, k, n, t] for (m, k, n), t in sorted(pts.items())] for lay, pts in self.layouts.items()}

    @classmethod
    def from_dict(cls, d, where: str) -> "ShapeTable":
        if not isinstance(d, dict) or not d:
            raise UserError(f"{where} is not an object of layouts: re-run python -m calibrate compute")
        layouts = {}
        for lay, rows in d.items():
            if lay not in LAYOUTS or not isinstance(rows, list):
                raise UserError(f"{where} has layout {lay!r}: use {', '.join(LAYOUTS)}; re-run python -m calibrate compute")
            pts = {}
            for r in rows:
                if not (isinstance(r, list) and len(r) == 4 and all(isinstance(x, (int, float)) and x > 0 for x in r)
                        and all(float(x).is_integer() for x in r[:3])):
                    raise UserError(f"{where} {lay} has a bad point {r!r} (want [m, k, n, seconds] > 0): "
                                    "re-run python -m calibrate compute")
                pts[(int(r[0]), int(r[1]), int(r[2]))] = float(r[3])
            layouts[lay] = pts
        return cls(layouts)
