"""The compute model of a GPU: how long a matmul, an attention core and a
bandwidth-bound pointwise op take, from a profile's optional ``"compute"`` section.

Section shape (per element size in bytes, "2" = fp16/bf16, "4" = fp32)::

    "compute": {
      "kind": "measured" | "assumed",
      "source": "how the figures were obtained",
      "launch_s": 4e-06,                  # a kernel's fixed cost
      "memory_Bps": 4.0e12,               # bytes moved (read + written) per second by a copy
      "op_Bps": {"elementwise": 3.2e12,   # optional: bytes per second of the memory-bound kernels other
                 "optimizer": 3.3e12, ...},  # than a copy, by kind (OPS; each falls back as OPS says)
      "matmul":    {"2": {"peak_flops": 9.9e14, "points": [[flops, seconds], ...]}, ...},
      "attention": {"2": {"peak_flops": 9.9e14, "points": [[flops, seconds], ...]}, ...},
      "attention_backward": {...},        # optional, as "attention": the core's backward
      "attention_copies": {...},          # optional, on the "elements" axis: the layer around the core
      "attention_copies_backward": {...}, # optional, the same for the backward
      "sources": {"matmul.2": "...", ...}   # one source per figure
    }

A band with measured ``points`` (flops -> median seconds, one per measured shape)
interpolates log-log between them, keeps the last point's throughput above it
and scales the first point's time down to ``launch_s`` below it; a band with
only ``peak_flops`` (datasheet figures) costs ``launch_s + flops / peak_flops``.
Matmul flops are 2 m k n; attention flops 4 b h s^2 d (QK^T and PV, counted
as if not causal; the measured points are causal, as GPT runs them, so the
causal saving lies in the fitted times). A measured attention band may instead
be on the axis of score elements b h s^2 (``"axis": "scores"``, what
``python -m calibrate compute`` writes): the core keeps its probabilities, so
its time is that of the passes over the b h s^2 scores (scale, mask, softmax,
the two batched matmuls reading and writing them), nearly independent of the
head dimension d (H200, bf16, s = 1024: 577 us at d = 64, 586 us at d = 128),
which flops, proportional to d, cannot express: on the flops axis, b = 4,
h = 32, s = 1024, d = 128 read as the s = 2048, d = 64 point, twice its time. Backward of a matmul costs twice its
forward (two matmuls of the same size).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from calibrate.errors import UserError

KINDS = ("measured", "assumed")


AXES = ("flops", "scores", "elements")
OPS = {  # memory-bound kernels with their own measured bandwidth -> the kind a profile without it falls back to
    "elementwise": None,  # pointwise work computed in fp32, casts, row reductions (None: the copy's memory_Bps)
    "optimizer": "elementwise",  # torch's fused Adam
    "embedding": "elementwise",  # the masked embedding's forward (calibrate.embedding)
    "embedding_backward": "elementwise",  # its backward: the dense weight gradient by sort and segment sums
}


@dataclass(frozen=True)
class Band:
    """The throughput of one op at one element size. ``axis`` says what the points' first
    value counts: flops, or (attention) score elements b h s^2."""

    peak_flops: float
    points: tuple[tuple[float, float], ...] = ()  # (flops or score elements, seconds), increasing
    axis: str = "flops"

    def seconds(self, flops: float, launch_s: float) -> float:
        if flops <= 0:
            return 0.0
        if not self.points:
            return launch_s + flops / self.peak_flops
        xs = [p[0] for p in self.points]
        if flops <= xs[0]:
            return max(launch_s, self.points[0][1] * flops / xs[0])
        if flops >= xs[-1]:
            return self.points[-1][1] * flops / xs[-1]
        i = bisect.bisect_right(xs, flops)
        (f0, t0), (f1, t1) = self.points[i - 1], self.points[i]
        w = math.log(flops / f0) / math.log(f1 / f0)
        return t0 ** (1 - w) * t1 ** w

    def to_dict(self) -> dict:
        out = {"peak_flops": self.peak_flops}
        if self.points:
            out["points"] = [list(p) for p in self.points]
        if self.axis != "flops":
            out["axis"] = self.axis
        return out


def _band(d, where: str) -> Band:
    if not isinstance(d, dict) or not isinstance(d.get("peak_flops"), (int, float)) or d["peak_flops"] <= 0:
        raise UserError(f"{where} needs a positive peak_flops: re-run python -m calibrate compute")
    pts = []
    for p in d.get("points", []):
        if not (isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in p)):
            raise UserError(f"{where} has a bad point {p!r} (want [flops, seconds] > 0): re-run python -m calibrate compute")
        pts.append((float(p[0]), float(p[1])))
    pts.sort()
    merged: list[tuple[float, float]] = []
    for f, t in pts:  # equal flops from two shapes: keep their mean
        if merged and merged[-1][0] == f:
            merged[-1] = (f, (merged[-1][1] + t) / 2)
        else:
            merged.append((f, t))
    axis = d.get("axis", "flops")
    if axis not in AXES or (axis != "flops" and not merged):
        raise UserError(f"{where} has axis {axis!r}: use flops, or scores or elements with measured points; "
                        "re-run python -m calibrate compute")
    return Band(float(d["peak_flops"]), tuple(merged), axis)


@dataclass(frozen=True)
class ComputeModel:
    source: str
    kind: str
    launch_s: float
    memory_Bps: float
    matmul: dict = field(default_factory=dict)  # str(dtype_bytes) -> Band
    attention: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    attention_backward: dict = field(default_factory=dict)  # measured backward of the core (else 2 x forward)
    attention_copies: dict = field(default_factory=dict)  # the layer around the core, forward (elements axis)
    attention_copies_backward: dict = field(default_factory=dict)  # and backward
    op_Bps: dict = field(default_factory=dict)  # OPS kind -> measured bytes per second

    def __hash__(self):
        return hash((self.source, self.kind, self.launch_s, self.memory_Bps))

    def _band(self, table: dict, what: str, dtype_bytes: int) -> Band:
        band = table.get(str(dtype_bytes))
        if band is None:
            raise UserError(
                f"the compute model ({self.source}) has no {what} figures for {dtype_bytes}-byte elements: "
                f"measure them with python -m calibrate compute --dtypes {'bf16' if dtype_bytes == 2 else 'fp32'}"
            )
        return band

    def matmul_seconds(self, m: int, k: int, n: int, dtype_bytes: int) -> float:
        return self._band(self.matmul, "matmul", dtype_bytes).seconds(2.0 * m * k * n, self.launch_s)

    def attention_seconds(self, batch: int, heads: int, seq: int, head_dim: int, dtype_bytes: int,
                          backward: bool = False) -> float:
        """The causal attention core's forward (``backward``: its backward; without measured
        backward figures, twice the forward, as two matmuls per forward matmul)."""
        if backward:
            band = self.attention_backward.get(str(dtype_bytes))
            if band is None:
                return 2 * self.attention_seconds(batch, heads, seq, head_dim, dtype_bytes)
            return self._attention(band, batch, heads, seq, head_dim)
        band = self.attention.get(str(dtype_bytes)) or self._band(self.matmul, "matmul", dtype_bytes)
        return self._attention(band, batch, heads, seq, head_dim)

    def attention_copy_seconds(self, batch: int, heads: int, seq: int, head_dim: int, dtype_bytes: int,
                               backward: bool = False) -> float | None:
        """The attention layer's work around its core (the fused QKV split into heads, the output
        made token-major; backward the gradients put back together), measured as the layer's time
        less the core's, on the axis of the layer's output elements b s h d; None if not measured."""
        band = (self.attention_copies_backward if backward else self.attention_copies).get(str(dtype_bytes))
        return None if band is None else band.seconds(float(batch * heads * seq * head_dim), self.launch_s)

    def _attention(self, band: Band, batch: int, heads: int, seq: int, head_dim: int) -> float:
        flops = 4.0 * batch * heads * seq * seq * head_dim
        if band.axis == "scores":
            return band.seconds(float(batch * heads * seq * seq), self.launch_s)
        return band.seconds(flops, self.launch_s)

    def memory_seconds(self, nbytes: float) -> float:
        """A copy of ``nbytes`` (read plus written)."""
        return 0.0 if nbytes <= 0 else self.launch_s + nbytes / self.memory_Bps

    def op_seconds(self, op: str, nbytes: float) -> float:
        """Memory-bound work of kind ``op`` (``OPS``) moving ``nbytes``, at its measured bandwidth or,
        without one, at the kind it falls back to (in the end the copy's)."""
        if nbytes <= 0:
            return 0.0
        kind = op
        while kind is not None and kind not in self.op_Bps:
            kind = OPS[kind]
        return self.launch_s + nbytes / (self.op_Bps[kind] if kind is not None else self.memory_Bps)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "source": self.source, "launch_s": self.launch_s, "memory_Bps": self.memory_Bps,
                **({"op_Bps": dict(self.op_Bps)} if self.op_Bps else {}),
                "matmul": {k: b.to_dict() for k, b in self.matmul.items()},
                "attention": {k: b.to_dict() for k, b in self.attention.items()},
                **{key: {k: b.to_dict() for k, b in getattr(self, key).items()}
                   for key in ("attention_backward", "attention_copies", "attention_copies_backward")
                   if getattr(self, key)},
                "sources": dict(self.sources)}

    @classmethod
    def from_dict(cls, d, origin: str = "profile") -> "ComputeModel":
        where = f"{origin}: compute section"
        if not isinstance(d, dict):
            raise UserError(f"{where} is not an object: re-run python -m calibrate compute")
        if d.get("kind") not in KINDS:
            raise UserError(f"{where} has kind {d.get('kind')!r}; use one of {', '.join(KINDS)}")
        for key in ("launch_s", "memory_Bps"):
            v = d.get(key)
            if not isinstance(v, (int, float)) or v < 0 or (key == "memory_Bps" and v == 0):
                raise UserError(f"{where} needs a non-negative {key}: re-run python -m calibrate compute")
        ops = d.get("op_Bps") or {}
        if not isinstance(ops, dict) or any(k not in OPS or not isinstance(v, (int, float)) or v <= 0
                                            for k, v in ops.items()):
            raise UserError(f"{where} has a bad op_Bps {ops!r} (want positive bytes per second for some of "
                            f"{', '.join(OPS)}): re-run python -m calibrate compute")
        if not d.get("matmul"):
            raise UserError(f"{where} has no matmul figures: re-run python -m calibrate compute")
        return cls(
            source=str(d.get("source", "")), kind=d["kind"], launch_s=float(d["launch_s"]),
            memory_Bps=float(d["memory_Bps"]),
            matmul={str(k): _band(v, f"{where} matmul {k}") for k, v in d["matmul"].items()},
            attention={str(k): _band(v, f"{where} attention {k}") for k, v in d.get("attention", {}).items()},
            **{key: {str(k): _band(v, f"{where} {key} {k}") for k, v in d.get(key, {}).items()}
               for key in ("attention_backward", "attention_copies", "attention_copies_backward")},
            sources=dict(d.get("sources", {})),
            op_Bps={k: float(v) for k, v in ops.items()},
        )
