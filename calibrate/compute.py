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
      "sdpa": {"2": {"gqa": "enable_gqa", "causal": true,   # optional: torch's scaled_dot_product_attention,
                     "points": [{"batch": 32, "heads": 8, "kv_heads": 1, "sequence": 512, "head_dim": 64,
                                 "forward_s": ..., "backward_s": ..., "backend": "flash"}, ...]}},
      "layer_s": {"rmsnorm": [fwd, bwd], ...},  # optional: seconds per element of the memory-bound pieces of
                                          # a user's step, timed as executed (calibrate.layers)
      "layer_call_s": {"rmsnorm": [fwd, bwd], ...},  # optional: their seconds per call beyond the per-element
                                          # rate (a piece of few elements runs below its large size's rate)
      "host_s": {"dtensor": [per_pass, per_step], ...},  # optional: the host's seconds to issue a step on each of
                                          # apply's paths (HOST_PATHS), per layer occurrence and micro-batch
                                          # (forward + backward) and per layer occurrence and step (the optimizer)
                                          # (autotune.execute.hostfit: measured where the kernels take less)
      "context_core": {"2": [[2, 32768, 1.16], ...]},  # optional: context parallelism's attention core on a
                                          # rank, [c, sequence, its time over the whole causal core's / c]
                                          # (tests/gpu/context_attention.py; autotune.apply.blockattn's blocks)
      "overlap": {"all_reduce": 1.08, "all_gather": 1.05, "reduce_scatter": 1.07,  # compute's slowdown while a
                  "peer": "nccl"},      # collective runs beside it (calibrate.overlap): "nccl" measured beside
                                          # a collective between 2 GPUs, "copy" beside a device copy (no peer GPU)
      "sources": {"matmul.2": "...", ...}   # one source per figure
    }

Multi-GPU planning needs ``host_s`` (the paths of several devices) and ``overlap``: a profile without them
is refused (``ComputeModel.missing_overheads``, ``autotune.sbp.steptime.require_overheads``), never
priced as if they cost nothing.

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

SDPA (``sdpa``, ``ComputeModel.sdpa_seconds``): torch's fused causal attention (flash and its
kin: nothing of size s^2 kept), measured per (head_dim, heads, kv_heads) configuration over
sequence lengths, each point with the backend it ran on. A query (b, h, kv, s, d) reads the
configuration of the measured head dimension nearest to d (on a log scale, the larger on a tie),
and of it the (heads, kv_heads) whose group size heads / kv_heads is nearest to h / kv (log scale;
then the nearest heads); along the sequence it interpolates log-log between the measured points'
time per (batch x head), t / (b h); the rest scales by flops: linearly in b h and in d / d_measured,
and as (s / s_end)^2 beyond the measured sequences; never below ``launch_s``. Without SDPA figures
for the element size, the causal flash flop count (forward 2 b h s^2 d, backward 2.5 times the
forward's) at the matmul band's rate.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from calibrate.errors import UserError
from calibrate.layers import KINDS as LAYER_KINDS

KINDS = ("measured", "assumed")
# autotune.plan's placement paths ("none": one device; "sequence": the tensor path with sequence parallelism)
HOST_PATHS = ("dtensor", "ddp", "fully_shard", "tensor", "sequence", "none")
# a path priced by another's host figure where the profile has none of its own: the tensor path (torchtitan's
# styles) by the DTensor figure, which is ParallelStyles on every Linear over a group of one, the same dispatch;
# sequence parallelism by the tensor path's (it adds a norm's gather and its DTensor stream to the same styles)
HOST_STANDIN = {"tensor": "dtensor", "sequence": "tensor"}
# the paths that place the model outside its blocks otherwise than a block's layers (the embedding and the head
# split by vocabulary, the loss vocabulary-parallel): their host figure outside the blocks measured apart
OUTSIDE_HOST_PATHS = ("tensor", "sequence")


def host_figure(figures: dict, path: str):
    """``figures[path]`` (a profile's or a module section's ``host_s``), or its stand-ins' in turn
    (``HOST_STANDIN``); None where none of them is there."""
    while path is not None and path not in figures:
        path = HOST_STANDIN.get(path)
    return figures.get(path) if path is not None else None


OVERLAP_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # what DDP's and FSDP's compute runs beside
OVERLAP_PEERS = ("nccl", "copy")  # measured beside a collective between GPUs, or beside a copy (no peer GPU)


AXES = ("flops", "scores", "elements")
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")  # torch.nn.attention.SDPBackend, by kernel family
SDPA_GQA = ("enable_gqa", "repeat")  # K/V heads shared by scaled_dot_product_attention(enable_gqa=True), or repeated first
SDPA_DIMS = ("batch", "heads", "kv_heads", "sequence", "head_dim")
SDPA_BACKWARD_FACTOR = 2.5  # without figures: backward flops over forward flops (flash attention's backward)
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


def _finite(v, low: float = 0.0) -> bool:
    """A JSON number (not a bool), finite and above ``low`` (at or above 0 where ``low`` is 0)."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and (v >= 0 if low == 0 else v > low))



def _layer_figures(d: dict, key: str, where: str, unit: str) -> dict:
    """A profile's ``layer_s`` or ``layer_call_s``: kind -> (forward, backward), validated."""
    figures = d.get(key) or {}
    if not isinstance(figures, dict) or any(
            k not in LAYER_KINDS or not isinstance(v, (list, tuple)) or len(v) != 2
            or any(not _finite(x) for x in v) for k, v in figures.items()):
        raise UserError(f"{where} has a bad {key} {figures!r} (want kind -> [forward, backward] non-negative "
                        f"{unit}, kinds of {', '.join(LAYER_KINDS)}): re-run python -m calibrate compute")
    return {k: (float(v[0]), float(v[1])) for k, v in figures.items()}


def fit_layer_piece(points) -> tuple[float, float]:
    """(seconds per call, seconds per element) of a memory-bound piece from its times at two or more sizes
    (``points``: (elements, seconds)): the least-squares line through them, its per-call cost at least 0
    (a negative intercept is noise: then the rate through the origin that fits best)."""
    pts = [(float(n), float(t)) for n, t in points]
    if len(pts) < 2 or len({n for n, _ in pts}) < 2 or any(n <= 0 or not math.isfinite(t) or t < 0 for n, t in pts):
        raise ValueError(f"a layer piece needs finite times at two or more distinct positive sizes: {points!r}")
    mean_n = sum(n for n, _ in pts) / len(pts)
    mean_t = sum(t for _, t in pts) / len(pts)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in pts) / sum((n - mean_n) ** 2 for n, _ in pts)
    call = mean_t - slope * mean_n
    if call < 0 or slope < 0:
        return 0.0, sum(n * t for n, t in pts) / sum(n * n for n, _ in pts)
    return call, slope

def _bands(d, where: str) -> dict[str, "Band"]:
    """A compute section's figures of one kind: element size ("2", "4") -> its band."""
    if not isinstance(d, dict):
        raise UserError(f"{where} is {str(d)[:40]!r}, not element size (bytes: \"2\", \"4\") -> "
                        f"{{peak_flops, points}}: re-run python -m calibrate compute")
    bad = [k for k in d if not (str(k).isdigit() and int(k) > 0)]
    if bad:
        raise UserError(f"{where} has the key {bad[0]!r}, not an element size in bytes (\"2\", \"4\"): re-run "
                        f"python -m calibrate compute")
    return {str(k): _band(v, f"{where} {k}") for k, v in d.items()}


def _band(d, where: str) -> Band:
    if not isinstance(d, dict) or not _finite(d.get("peak_flops")) or d["peak_flops"] <= 0:
        raise UserError(f"{where} needs a finite positive peak_flops: re-run python -m calibrate compute")
    pts = []
    if not isinstance(d.get("points", []), list):
        raise UserError(f"{where} has points {d['points']!r}, not a list of [flops, seconds]: re-run python -m "
                        f"calibrate compute")
    for p in d.get("points", []):
        if not (isinstance(p, list) and len(p) == 2 and all(_finite(x) and x > 0 for x in p)):
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
class SdpaPoint:
    """One measured shape of causal SDPA: forward and backward medians, and the backend it ran on."""

    batch: int
    heads: int
    kv_heads: int
    sequence: int
    head_dim: int
    forward_s: float
    backward_s: float
    backend: str

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in (*SDPA_DIMS, "forward_s", "backward_s", "backend")}


def _log_nearest(values, want: float):
    """The value nearest to ``want`` on a log scale; the larger on a tie."""
    return min(values, key=lambda v: (abs(math.log(v / want)), -v))


@dataclass(frozen=True)
class SdpaTable:
    """The measured SDPA grid of one element size (the rule: the module docstring)."""

    points: tuple[SdpaPoint, ...]
    gqa: str = "enable_gqa"

    def seconds(self, batch: int, heads: int, kv_heads: int, sequence: int, head_dim: int,
                backward: bool, launch_s: float) -> float:
        d = _log_nearest({p.head_dim for p in self.points}, head_dim)
        same_d = [p for p in self.points if p.head_dim == d]
        group = heads / kv_heads
        h, kv = min({(p.heads, p.kv_heads) for p in same_d},
                    key=lambda c: (abs(math.log(c[0] / c[1] / group)), abs(math.log(c[0] / heads)), -c[0]))
        row = [(p.sequence, (p.backward_s if backward else p.forward_s) / (p.batch * p.heads))
               for p in same_d if (p.heads, p.kv_heads) == (h, kv)]  # sequences increasing (checked on load)
        seqs = [s for s, _ in row]
        if sequence <= seqs[0] or sequence >= seqs[-1]:
            s0, u0 = row[0] if sequence <= seqs[0] else row[-1]
            per_head = u0 * (sequence / s0) ** 2
        else:
            i = bisect.bisect_right(seqs, sequence)
            (s0, u0), (s1, u1) = row[i - 1], row[i]
            w = math.log(sequence / s0) / math.log(s1 / s0)
            per_head = u0 ** (1 - w) * u1 ** w
        return max(launch_s, per_head * batch * heads * head_dim / d)

    def backends(self) -> list[str]:
        return sorted({p.backend for p in self.points})

    def to_dict(self) -> dict:
        return {"gqa": self.gqa, "causal": True, "points": [p.to_dict() for p in self.points]}


def _sdpa(d, where: str) -> SdpaTable:
    fix = "re-run python -m calibrate compute"
    if not isinstance(d, dict) or not isinstance(d.get("points"), list) or not d["points"]:
        raise UserError(f"{where} needs a non-empty list of points: {fix}")
    if d.get("gqa", "enable_gqa") not in SDPA_GQA or d.get("causal", True) is not True:
        raise UserError(f"{where} has gqa {d.get('gqa')!r}, causal {d.get('causal')!r} (want gqa one of "
                        f"{', '.join(SDPA_GQA)}, causal true): {fix}")
    points, last = [], {}
    for p in d["points"]:
        ok = isinstance(p, dict) and set(p) == {*SDPA_DIMS, "forward_s", "backward_s", "backend"}
        ok = ok and all(isinstance(p[k], int) and not isinstance(p[k], bool) and p[k] > 0 for k in SDPA_DIMS)
        ok = ok and all(isinstance(p[k], (int, float)) and not isinstance(p[k], bool) and math.isfinite(p[k])
                        and p[k] > 0 for k in ("forward_s", "backward_s"))
        if not ok or p["backend"] not in SDPA_BACKENDS or p["heads"] % p["kv_heads"]:
            raise UserError(f"{where} has a bad point {p!r} (want positive integer {', '.join(SDPA_DIMS)} with "
                            f"kv_heads dividing heads, finite positive forward_s and backward_s, backend one of "
                            f"{', '.join(SDPA_BACKENDS)}): {fix}")
        key = (p["head_dim"], p["heads"], p["kv_heads"])
        if p["sequence"] <= last.get(key, 0):
            raise UserError(f"{where}: the points of head_dim {key[0]}, heads {key[1]}, kv_heads {key[2]} are not "
                            f"in increasing sequence order (sequence {p['sequence']} after {last[key]}): {fix}")
        last[key] = p["sequence"]
        points.append(SdpaPoint(*(p[k] for k in SDPA_DIMS), float(p["forward_s"]), float(p["backward_s"]),
                                p["backend"]))
    return SdpaTable(tuple(points), d.get("gqa", "enable_gqa"))


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
    sdpa: dict = field(default_factory=dict)  # str(dtype_bytes) -> SdpaTable: torch's fused causal SDPA
    layer_s: dict = field(default_factory=dict)  # calibrate.layers kind -> (forward, backward) seconds per element
    layer_call_s: dict = field(default_factory=dict)  # the same kinds -> (forward, backward) seconds per call
    host_s: dict = field(default_factory=dict)  # HOST_PATHS path -> (per layer occurrence and micro-batch, per step)
    host_outside_s: dict = field(default_factory=dict)  # OUTSIDE_HOST_PATHS path -> (per micro-batch, per step)
    overlap: dict = field(default_factory=dict)  # OVERLAP_COLLECTIVES -> compute's slowdown beside it; "peer"
    context_core: dict = field(default_factory=dict)  # str(dtype_bytes) -> [(c, sequence, ratio), ...]

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

    def sdpa_seconds(self, batch: int, heads: int, kv_heads: int, sequence: int, head_dim: int, act_bytes: int,
                     backward: bool = False) -> float:
        """Causal ``scaled_dot_product_attention`` (its forward, or ``backward``: its backward) on
        [batch, heads, sequence, head_dim] queries and kv_heads K/V heads: the measured grid
        interpolated (module docstring), else the causal flash flop count at the matmul rate."""
        table = self.sdpa.get(str(act_bytes))
        if table is not None:
            return table.seconds(batch, heads, kv_heads, sequence, head_dim, backward, self.launch_s)
        flops = 2.0 * batch * heads * sequence * sequence * head_dim * (SDPA_BACKWARD_FACTOR if backward else 1.0)
        return self._band(self.matmul, "matmul", act_bytes).seconds(flops, self.launch_s)

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

    def layer_seconds(self, kind: str, elems: float) -> tuple[float, float] | None:
        """(forward, backward) seconds of one call of a memory-bound piece of a user's step
        (``calibrate.layers``) over ``elems`` elements, as measured: its per-call cost plus its
        per-element rate times ``elems`` (``fit_layer_piece``); None where the profile has no figure."""
        per = self.layer_s.get(kind)
        if per is None:
            return None
        if elems <= 0:
            return 0.0, 0.0
        call = self.layer_call_s.get(kind, (0.0, 0.0))
        return call[0] + per[0] * elems, call[1] + per[1] * elems

    def host_seconds(self, path: str, occurrences: int) -> tuple[float, float] | None:
        """(per micro-batch, per step) seconds the host takes to issue the forward and backward of
        ``occurrences`` layer occurrences, and their optimizer step, placed on apply's ``path``; None where the
        profile has no host figures for that path."""
        per = host_figure(self.host_s, path)
        if per is None:
            return None
        return occurrences * per[0], occurrences * per[1]

    def context_core_ratio(self, c: int, sequence: int, act_bytes: int) -> float:
        """A context-parallel rank's attention core over the whole causal core's / ``c`` (``context_core``): of
        the measured c nearest to ``c`` (log scale, the larger on a tie), interpolated in log sequence between
        its points and the nearest point's outside them; 1 (the ideal split) where none is measured."""
        points = self.context_core.get(str(act_bytes))
        if not points:
            return 1.0
        near = min({p[0] for p in points}, key=lambda m: (abs(math.log(m / c)), -m))
        row = sorted((p[1], p[2]) for p in points if p[0] == near)
        x = math.log(sequence)
        if x <= math.log(row[0][0]):
            return row[0][1]
        for (s0, r0), (s1, r1) in zip(row, row[1:]):
            if x <= math.log(s1):
                w = (x - math.log(s0)) / (math.log(s1) - math.log(s0))
                return r0 + w * (r1 - r0)
        return row[-1][1]

    def overlap_slowdown(self, collective: str) -> float:
        """Compute's slowdown while ``collective`` (``OVERLAP_COLLECTIVES``) runs beside it: 1 without the figure
        (planning of several devices refuses such a profile first: ``missing_overheads``)."""
        return float(self.overlap.get(collective, 1.0))

    def missing_overheads(self) -> list[str]:
        """The figures multi-GPU planning needs that this model lacks (module docstring)."""
        paths = [p for p in HOST_PATHS if p != "none" and p not in self.host_s and p not in HOST_STANDIN]
        return ([f"host_s ({', '.join(paths)})"] if paths else []) + \
            (["overlap"] if any(c not in self.overlap for c in OVERLAP_COLLECTIVES) else [])

    def to_dict(self) -> dict:
        return {"kind": self.kind, "source": self.source, "launch_s": self.launch_s, "memory_Bps": self.memory_Bps,
                **({"host_s": {k: list(v) for k, v in self.host_s.items()}} if self.host_s else {}),
                **({"host_outside_s": {k: list(v) for k, v in self.host_outside_s.items()}}
                   if self.host_outside_s else {}),
                **({"overlap": dict(self.overlap)} if self.overlap else {}),
                **({"context_core": {k: [list(p) for p in v] for k, v in self.context_core.items()}}
                   if self.context_core else {}),
                **({"layer_s": {k: list(v) for k, v in self.layer_s.items()}} if self.layer_s else {}),
                **({"layer_call_s": {k: list(v) for k, v in self.layer_call_s.items()}} if self.layer_call_s else {}),
                **({"op_Bps": dict(self.op_Bps)} if self.op_Bps else {}),
                "matmul": {k: b.to_dict() for k, b in self.matmul.items()},
                "attention": {k: b.to_dict() for k, b in self.attention.items()},
                **{key: {k: b.to_dict() for k, b in getattr(self, key).items()}
                   for key in ("attention_backward", "attention_copies", "attention_copies_backward")
                   if getattr(self, key)},
                **({"sdpa": {k: t.to_dict() for k, t in self.sdpa.items()}} if self.sdpa else {}),
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
            if not _finite(v) or (key == "memory_Bps" and v == 0):
                raise UserError(f"{where} has {key} {v!r}; want a finite non-negative number (memory_Bps above 0): "
                                "re-run python -m calibrate compute")
        ops = d.get("op_Bps") or {}
        if not isinstance(ops, dict) or any(k not in OPS or not _finite(v) or v <= 0
                                            for k, v in ops.items()):
            raise UserError(f"{where} has a bad op_Bps {ops!r} (want finite positive bytes per second for some of "
                            f"{', '.join(OPS)}): re-run python -m calibrate compute")
        if not d.get("matmul"):
            raise UserError(f"{where} has no matmul figures: re-run python -m calibrate compute")
        layers, calls = (_layer_figures(d, key, where, unit) for key, unit in
                         (("layer_s", "seconds per element"), ("layer_call_s", "seconds per call")))
        if set(calls) - set(layers):
            raise UserError(f"{where} has layer_call_s for {', '.join(sorted(set(calls) - set(layers)))} without its "
                            "layer_s: re-run python -m calibrate compute")
        return cls(
            source=str(d.get("source", "")), kind=d["kind"], launch_s=float(d["launch_s"]),
            memory_Bps=float(d["memory_Bps"]),
            **{key: _bands(d.get(key, {}), f"{where} {key}")
               for key in ("matmul", "attention", "attention_backward", "attention_copies",
                           "attention_copies_backward")},
            sources=dict(d.get("sources", {})),
            op_Bps={k: float(v) for k, v in ops.items()},
            sdpa=_sdpa_tables(d.get("sdpa", {}), where),
            layer_s=layers, layer_call_s=calls, host_s=host_figures(d.get("host_s"), where),
            host_outside_s=host_figures(d.get("host_outside_s"), where, OUTSIDE_WHAT),
            overlap=overlap_figures(d.get("overlap"), where),
            context_core=context_figures(d.get("context_core"), where),
        )


def context_figures(figures, where: str) -> dict:
    """A profile's ``context_core``: str(dtype bytes) -> [(c, sequence, ratio), ...], each c an integer of at least
    2, each sequence a positive integer, each ratio between 0.5 and 100 (below 1 is noise: a rank does at least its
    share of the work)."""
    figures = figures or {}
    try:
        out = {str(k): [(int(c), int(s), float(r)) for c, s, r in v] for k, v in figures.items()}
    except (TypeError, ValueError, AttributeError):
        out = None
    if out is None or any(c < 2 or s < 1 or not (_finite(r) and 0.5 <= r <= 100) for v in out.values()
                          for c, s, r in v):
        raise UserError(f"{where} has a bad context_core {figures!r} (want [c, sequence, ratio] points per dtype, c "
                        f"at least 2, the ratio between 0.5 and 100): re-run tests/gpu/context_attention.py")
    return out


def overlap_figures(figures, where: str, fix: str = "re-run python -m calibrate compute on 2 or more GPUs") -> dict:
    """A profile's ``overlap`` (its compute section's, or its module section's): collective -> slowdown (0.5 to 5:
    below 1 is noise, compute does not run faster beside a collective), and the peer it was measured beside."""
    figures = figures or {}
    ok = isinstance(figures, dict) and figures.get("peer", "nccl") in OVERLAP_PEERS and all(
        k in OVERLAP_COLLECTIVES and _finite(v) and 0.5 <= v <= 5 for k, v in figures.items() if k != "peer")
    if not ok:
        raise UserError(f"{where} has a bad overlap {figures!r} (want slowdowns between 0.5 and 5 for "
                        f"{', '.join(OVERLAP_COLLECTIVES)} and peer one of {', '.join(OVERLAP_PEERS)}): {fix}")
    return dict(figures)


OUTSIDE_WHAT = ("host_outside_s", "of the model outside its blocks")


def host_figures(figures, where: str, what: tuple = ("host_s", "per layer occurrence")) -> dict:
    """A profile's ``host_s`` (path -> (seconds per layer occurrence and micro-batch, per layer occurrence and
    step)) or, ``what`` ``OUTSIDE_WHAT``, its ``host_outside_s`` (the same of the whole model outside its
    blocks), validated (non-negative, under a second, paths of ``HOST_PATHS``)."""
    figures = figures or {}
    if not isinstance(figures, dict) or any(
            k not in HOST_PATHS or not isinstance(v, (list, tuple)) or len(v) != 2
            or any(not _finite(x) or x >= 1 for x in v) for k, v in figures.items()):
        raise UserError(f"{where} has a bad {what[0]} {figures!r} (want path -> [per micro-batch, per step] seconds "
                        f"{what[1]}, 0 <= s < 1, paths of {', '.join(HOST_PATHS)}): re-run python -m calibrate "
                        f"compute, or python -m calibrate module for a module section")
    return {k: (float(v[0]), float(v[1])) for k, v in figures.items()}


def _sdpa_tables(d, where: str) -> dict:
    if not isinstance(d, dict):
        raise UserError(f"{where} has sdpa {d!r}, not element size -> figures: re-run python -m calibrate compute")
    return {str(k): _sdpa(v, f"{where} sdpa {k}") for k, v in d.items()}
