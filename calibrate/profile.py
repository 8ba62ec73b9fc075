"""Fitted alpha-beta profiles: a versioned JSON record and the API autotune uses.

A profile holds, per network tier ("intra": the ranks of one node; "inter":
ranks on several nodes) and per collective, one fitted model per measured group
size p. Each model is piecewise over message size: a list of segments, each with
its own alpha (seconds) and beta (seconds per byte), so that
T(n) = a(p)*alpha + b(p)*n*beta with the ring coefficients of
``calibrate.collectives.ring_coefficients``.

Costing a group (``Group(ranks, nodes)``):
- one node (nodes == 1): the intra tier;
- several nodes: the inter tier with p = ranks. A group that spans nodes with
  several ranks per node is costed as one flat ring over all its ranks on the
  inter tier's alpha and beta: the ring's bottleneck edges are the inter-node
  ones, which carry the same bytes per edge as any other edge of the ring.
- a group size that the profile did not measure uses the measured p nearest on a
  log scale: alpha and beta are per-hop constants of the ring model, so they
  carry across p (``calibrate fit`` reports how flat they really are).

The optional ``device`` section names the GPU of one rank and its memory:
``{"name", "total_bytes", "usable_bytes", "source"}``. Usable bytes are what one training
process can allocate: the card's total less the CUDA context (its runtime, the kernels of
torch, cuBLAS and attention loaded) and whatever else holds memory on it. ``python -m
calibrate compute`` measures it (``calibrate/cli/compute.py``: free memory at the end of its
run, after releasing torch's cache, plus what torch still holds); the embedded profiles state
their source. ``Profile.memory_bytes`` is the usable figure, or None without a section.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from calibrate.collectives import Collective, busbw_factor, ring_coefficients
from calibrate.compute import ComputeModel
from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.records import check_header, header

KIND = "commtune.profile"
VERSION = 2
# version 1: segments only; 2 adds, per model, how it was built ("method") and the switch points
# between its segments ("switches"); version 1 files load with no switches recorded
READ_VERSIONS = (1, 2)
REFIT = "refit it with python -m calibrate fit"
TIERS = ("intra", "inter")


@dataclass(frozen=True)
class Group:
    """A communicator: how many ranks, on how many nodes."""

    ranks: int
    nodes: int = 1

    def __post_init__(self):
        if self.ranks < 1 or self.nodes < 1 or self.nodes > self.ranks:
            raise UserError(
                f"bad group: {self.ranks} ranks on {self.nodes} nodes (need ranks >= nodes >= 1)"
            )

    @property
    def tier(self) -> str:
        return "intra" if self.nodes == 1 else "inter"


@dataclass
class Segment:
    """One piece of a piecewise alpha-beta fit, valid for min_bytes <= n < max_bytes."""

    min_bytes: float
    max_bytes: float
    alpha: float
    beta: float
    fit: dict = field(default_factory=dict)

    def time(self, coll: Collective, nbytes: float, p: int) -> float:
        a, b = ring_coefficients(coll, p)
        return a * self.alpha + b * nbytes * self.beta


@dataclass
class CollectiveModel:
    """The fitted segments of one collective on one tier at one group size, with
    the measured points they were fitted to ([bytes, median seconds]), the
    held-out validation of the fit, where the profile was measured, how the
    model was built (``method``) and where its curve steps (``switches``: per
    boundary between segments, the sizes measured on each side, the jump, and
    whether the step was located within 1/32 octave)."""

    segments: list[Segment]
    points: list[list[float]] = field(default_factory=list)
    validation: dict = field(default_factory=dict)
    method: str = "segments"
    switches: list[dict] = field(default_factory=list)

    def segment_for(self, nbytes: float) -> Segment:
        return segment_for(self.segments, nbytes)

    def time(self, coll: Collective, nbytes: float, p: int) -> float:
        return segments_time(coll, p, self.segments, nbytes)


def segment_for(segments: list[Segment], nbytes: float) -> Segment:
    for seg in segments:
        if nbytes < seg.max_bytes:
            return seg
    return segments[-1]


def segments_time(coll: Collective, p: int, segments: list[Segment], nbytes: float) -> float:
    """Seconds at ``nbytes`` from piecewise segments. Between the last measured size of one
    segment and the first of the next (``fit["last_bytes"]``, ``fit["first_bytes"]``) the
    switch (an NCCL protocol or algorithm change) lies at a size nobody measured, so the
    prediction blends both segments geometrically, weighted by the log-distance to each
    side: the least worst-case error when the switch can be anywhere in the gap."""
    k = next((i for i, s in enumerate(segments) if nbytes < s.max_bytes), len(segments) - 1)
    seg = segments[k]
    lo_seg = segments[k - 1] if k > 0 and nbytes < seg.fit.get("first_bytes", 0) else None
    hi_seg = segments[k + 1] if k + 1 < len(segments) and nbytes > seg.fit.get("last_bytes", math.inf) else None
    pair = (lo_seg, seg) if lo_seg else (seg, hi_seg) if hi_seg else None
    if pair is None or "last_bytes" not in pair[0].fit or "first_bytes" not in pair[1].fit:
        return seg.time(coll, nbytes, p)
    last, first = pair[0].fit["last_bytes"], pair[1].fit["first_bytes"]
    w = math.log(nbytes / last) / math.log(first / last)
    t_lo, t_hi = pair[0].time(coll, nbytes, p), pair[1].time(coll, nbytes, p)
    if t_lo <= 0 or t_hi <= 0:
        return (1 - w) * t_lo + w * t_hi
    return t_lo ** (1 - w) * t_hi ** w


@dataclass(frozen=True)
class Device:
    """The GPU of one rank: its name, total and usable memory (module docstring)."""

    name: str
    total_bytes: int
    usable_bytes: int
    source: str

    def to_dict(self) -> dict:
        return {"name": self.name, "total_bytes": self.total_bytes, "usable_bytes": self.usable_bytes,
                "source": self.source}

    @classmethod
    def from_dict(cls, d, origin: str = "profile") -> "Device":
        fix = "re-run python -m calibrate compute, or fix the section by hand"
        if not isinstance(d, dict) or set(d) != {"name", "total_bytes", "usable_bytes", "source"}:
            raise UserError(f"{origin}: the device section needs exactly name, total_bytes, usable_bytes and "
                            f"source: {fix}")
        if not isinstance(d["name"], str) or not d["name"] or not isinstance(d["source"], str):
            raise UserError(f"{origin}: the device's name and source must be text (name non-empty): {fix}")
        sizes = [d[k] for k in ("total_bytes", "usable_bytes")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes) or sizes[1] > sizes[0]:
            raise UserError(f"{origin}: the device has total_bytes {sizes[0]!r} and usable_bytes {sizes[1]!r}; want "
                            f"positive integers, usable at most total: {fix}")
        return cls(d["name"], d["total_bytes"], d["usable_bytes"], d["source"])


@dataclass
class Profile:
    name: str
    provenance: dict
    hardware: dict = field(default_factory=dict)
    software: dict = field(default_factory=dict)
    timing_mode: str = ""
    # tier -> collective -> str(p) -> CollectiveModel
    tiers: dict[str, dict[str, dict[str, CollectiveModel]]] = field(default_factory=dict)
    compute: ComputeModel | None = None  # the GPU's compute model (``calibrate.compute``), if known
    device: Device | None = None  # the GPU of one rank and its memory, if known

    @property
    def memory_bytes(self) -> int | None:
        """Usable GPU memory per device in bytes (the device section), or None when not known."""
        return None if self.device is None else self.device.usable_bytes

    # ---- costing -------------------------------------------------------------------
    def model(self, coll: Collective | str, group: Group) -> tuple[CollectiveModel, int]:
        coll = Collective.parse(coll) if isinstance(coll, str) else coll
        tier = group.tier
        if tier not in self.tiers or not self.tiers[tier]:
            raise UserError(
                f"profile {self.name!r} has no {tier} tier; calibrate across "
                f"{'nodes' if tier == 'inter' else 'one node'} or pick a profile that has it "
                f"(python -m calibrate profiles)"
            )
        by_p = self.tiers[tier].get(coll.value)
        if not by_p:
            raise UserError(
                f"profile {self.name!r} has no {coll.value} on the {tier} tier; "
                f"calibrate it (python -m calibrate run --collectives {coll.value})"
            )
        p = group.ranks
        key = str(p) if str(p) in by_p else min(
            by_p, key=lambda k: (abs(math.log(int(k)) - math.log(max(p, 2))), int(k))
        )
        return by_p[key], p

    def time(self, coll: Collective | str, nbytes: float, group: Group) -> float:
        """Predicted seconds for one collective of ``nbytes`` (nccl-tests' size) on ``group``."""
        if group.ranks == 1 or nbytes <= 0:
            return 0.0
        coll = Collective.parse(coll) if isinstance(coll, str) else coll
        model, p = self.model(coll, group)
        return model.time(coll, nbytes, p)

    def busbw(self, coll: Collective | str, nbytes: float, group: Group) -> float:
        """Predicted bus bandwidth in bytes per second (nccl-tests' definition)."""
        coll = Collective.parse(coll) if isinstance(coll, str) else coll
        t = self.time(coll, nbytes, group)
        return 0.0 if t <= 0 else nbytes / t * busbw_factor(coll, group.ranks)

    def collectives(self, tier: str) -> list[str]:
        return sorted(self.tiers.get(tier, {}))

    # ---- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            **header(KIND, VERSION),
            "name": self.name,
            "provenance": self.provenance,
            "hardware": self.hardware,
            "software": self.software,
            "timing_mode": self.timing_mode,
            "tiers": {
                tier: {
                    coll: {p: asdict(m) for p, m in by_p.items()}
                    for coll, by_p in colls.items()
                }
                for tier, colls in self.tiers.items()
            },
            **({"compute": self.compute.to_dict()} if self.compute is not None else {}),
            **({"device": self.device.to_dict()} if self.device is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict, origin: str = "profile") -> "Profile":
        check_header(d, KIND, READ_VERSIONS, "commtune profile", REFIT, origin)
        for key in ("name", "provenance", "tiers"):
            if key not in d:
                raise UserError(f"{origin} lacks the field {key!r}: refit it with python -m calibrate fit")
        tiers: dict[str, dict[str, dict[str, CollectiveModel]]] = {}
        if not isinstance(d["tiers"], dict) or not all(isinstance(c, dict) and all(isinstance(m, dict)
                                                                                  for m in c.values())
                                                       for c in d["tiers"].values()):
            raise UserError(f"{origin}: 'tiers' is not tier -> collective -> group size -> model: "
                            f"refit it with python -m calibrate fit")
        for tier, colls in d["tiers"].items():
            if tier not in TIERS:
                raise UserError(f"{origin}: unknown tier {tier!r} (expected one of {', '.join(TIERS)})")
            tiers[tier] = {}
            for coll, by_p in colls.items():
                Collective.parse(coll)
                tiers[tier][coll] = {}
                for p, m in by_p.items():
                    if not str(p).isdigit() or int(p) < 2:
                        raise UserError(f"{origin}: {tier}/{coll} has a bad group size {p!r}")
                    segs = []
                    if not isinstance(m, dict) or not isinstance(m.get("segments", []), list):
                        raise UserError(f"{origin}: {tier}/{coll}/p={p} is not a model with a list of segments: "
                                        f"refit it with python -m calibrate fit")
                    for s in m.get("segments", []):
                        seg = _segment(s, f"{origin}: {tier}/{coll}/p={p}")
                        if not (seg.alpha >= 0 and seg.beta >= 0 and math.isfinite(seg.alpha)
                                and math.isfinite(seg.beta)):
                            raise UserError(
                                f"{origin}: {tier}/{coll}/p={p} has a negative or non-finite alpha or beta"
                            )
                        segs.append(seg)
                    if not segs:
                        raise UserError(f"{origin}: {tier}/{coll}/p={p} has no segments")
                    tiers[tier][coll][str(p)] = CollectiveModel(
                        sorted(segs, key=lambda s: s.min_bytes), m.get("points", []), m.get("validation", {}),
                        m.get("method", "segments"), m.get("switches", []))
        return cls(
            name=d["name"],
            provenance=d["provenance"],
            hardware=d.get("hardware", {}),
            software=d.get("software", {}),
            timing_mode=d.get("timing_mode", ""),
            tiers=tiers,
            compute=ComputeModel.from_dict(d["compute"], origin) if "compute" in d else None,
            device=Device.from_dict(d["device"], origin) if "device" in d else None,
        )

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict(), "profile")

    @classmethod
    def load(cls, name_or_path: str | Path) -> "Profile":
        """Load an embedded profile by name (``python -m calibrate profiles``) or a JSON file."""
        p = Path(name_or_path)
        if p.suffix == ".json" or p.exists():
            data = read_json(p, "profile file", "fit one with python -m calibrate fit, or name an embedded profile")
            return cls.from_dict(data, origin=f"profile file {str(p)!r}")
        names = embedded_profile_names()
        if str(name_or_path) not in names:
            raise UserError(
                f"unknown profile {str(name_or_path)!r}: give a JSON file or one of {', '.join(names)}"
            )
        text = resources.files("calibrate.profiles").joinpath(f"{name_or_path}.json").read_text()
        return cls.from_dict(json.loads(text), origin=f"embedded profile {name_or_path!r}")


DEFAULT_PROFILE = "h200-nvlink+ib400"


def _segment(s, where: str) -> Segment:
    """A Segment from its JSON, every number checked to be one."""
    fields = ("min_bytes", "max_bytes", "alpha", "beta")
    if not isinstance(s, dict) or any(k not in s for k in fields) or set(s) - set(fields) - {"fit"}:
        raise UserError(f"{where}: a segment needs exactly {', '.join(fields)} (and fit): "
                        f"refit it with python -m calibrate fit")
    bad = [k for k in fields if isinstance(s[k], bool) or not isinstance(s[k], (int, float))]
    if bad:
        raise UserError(f"{where}: segment field {bad[0]} is {s[bad[0]]!r}, not a number: "
                        f"fix it or refit with python -m calibrate fit")
    return Segment(float(s["min_bytes"]), float(s["max_bytes"]), float(s["alpha"]), float(s["beta"]),
                   s.get("fit", {}) if isinstance(s.get("fit", {}), dict) else {})


def embedded_profile_names() -> list[str]:
    return sorted(
        f.name[:-5]
        for f in resources.files("calibrate.profiles").iterdir()
        if f.name.endswith(".json")
    )
