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
- groups crossing nodes share each node's network with the other groups that
  run at once (one per GPU of a node for a one-rank-per-node group): each
  model records ``groups_per_node``, how many groups of its size crossed each
  node's network at once when it was measured (``calibrate run``'s inter groups:
  one per rank of a node; its world: one; an assumed datasheet figure: one).
  ``Profile.time(..., groups_per_node=k)`` prices k groups at once: the model
  at k / groups_per_node times the bytes, the bandwidth term of the node's
  network shared that many more (or fewer) ways than when measured.

The optional ``device`` section names the GPU of one rank and its memory:
``{"name", "total_bytes", "usable_bytes", "source"}``. Usable bytes are what one training
process can allocate: the card's total less the CUDA context (its runtime, the kernels of
torch, cuBLAS and attention loaded) and whatever else holds memory on it. ``python -m
calibrate compute`` measures it (``calibrate/cli/compute.py``: free memory at the end of its
run, after releasing torch's cache, plus what torch still holds); the embedded profiles state
their source. ``Profile.memory_bytes`` is the usable figure less the fragmentation allowance, or None
without a section.

Two optional keys of their own (``bandwidth_per`` and ``memory_fragmentation``) say what the figures mean:

- ``"bandwidth_per": {"inter": {"per": "gpu" | "node", "source": "..."}, "intra": {...}}``: whether a
  tier's bandwidth (its beta) is each GPU's own link or the whole node's network. "node" (the default, and
  what a measured tier's ``groups_per_node`` counts against): the figure is one group's while
  ``groups_per_node`` groups crossed each node; "gpu" (a datasheet figure of one NIC per GPU, InfiniBand
  NDR on H100/H200 DGX nodes): a node's network is that figure times its GPUs, so k groups crossing a node of
  g GPUs each run at k / g of it (8 one-rank-per-node data-parallel groups on 8 NICs: each at the figure).
- ``"memory_fragmentation": {"fraction": 0.1, "source": "..."}``: what torch's caching allocator holds
  reserved but unallocated at a training step's peak, as a fraction of the usable memory; the search's
  memory check (``memory_bytes``) keeps that much free. ``DEFAULT_FRAGMENTATION`` where a profile with a
  device section does not state it. Its optional ``"expandable_segments": {"fraction": ..., "source": ...}``
  is the same figure under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torchtitan's launcher sets
  it): the allowance of a plan searched for that allocator (``memory_bytes_under``, ``ALLOCATORS``).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

from calibrate.allocator import ALLOCATORS
from calibrate.collectives import Collective, busbw_factor, ring_coefficients
from calibrate.compute import ComputeModel
from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.module import ModuleSection
from calibrate.residuals import Residuals
from calibrate.records import check_header, header

KIND = "commtune.profile"
VERSION = 2
# version 1: segments only; 2 adds, per model, how it was built ("method") and the switch points
# between its segments ("switches"), and optionally how many groups crossed each node's network at once
# ("groups_per_node", 1 where absent); version 1 files load with no switches recorded
READ_VERSIONS = (1, 2)
REFIT = "refit it with python -m calibrate fit"
BY_HAND = "fix the profile by hand (see calibrate/profile.py)"  # the stated meanings no command writes
TIERS = ("intra", "inter")
# the ranges a fitted segment's figures can have: no collective starts slower than a second, and
# none moves fewer than a kilobyte a second; sizes up to the open end's 2**62 bytes
MAX_ALPHA_S = 1.0
MAX_BETA_S_PER_BYTE = 1e-3
MAX_SEGMENT_BYTES = float(2 ** 62)
METHODS = ("segments", "interpolate")
PER = ("gpu", "node")  # bandwidth_per: a tier's bandwidth is each GPU's link or the node's whole network
# reserved minus allocated at a training step's peak, as a fraction of the usable memory, where a profile does
# not state its own: GMLake (Guo et al., ASPLOS 2024, abstract) reports torch's caching allocator wasting 9.2 GB
# on average over eight LLM training runs on A100 80 GB (11.5% of the card); the project's own measurement of
# a Megatron-style step is tests/gpu/fragmentation.py (reports/records/published.md)
DEFAULT_FRAGMENTATION = 0.10


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
    model was built (``method``), where its curve steps (``switches``: per
    boundary between segments, the sizes measured on each side, the jump, and
    whether the step was located within 1/32 octave) and how many groups of
    this size crossed each node's network at once when it was measured
    (``groups_per_node``; module docstring)."""

    segments: list[Segment]
    points: list[list[float]] = field(default_factory=list)
    validation: dict = field(default_factory=dict)
    method: str = "segments"
    switches: list[dict] = field(default_factory=list)
    groups_per_node: int = 1

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


@dataclass(frozen=True)
class Figure:
    """A stated meaning with its source: a tier's bandwidth scope (``per`` of PER) or the fragmentation
    allowance (``fraction``)."""

    value: str | float
    source: str


def _fraction(frag, origin: str, what: str) -> Figure | None:
    """A ``{"fraction", "source"}`` allowance (``memory_fragmentation`` and its ``expandable_segments``), checked."""
    if frag is None:
        return None
    if not isinstance(frag, dict) or not _is_number(frag.get("fraction")) or not 0 <= frag["fraction"] < 1 \
            or not isinstance(frag.get("source"), str):
        raise UserError(f"{origin}: {what} is {_short(frag)}; want {{\"fraction\": a number in [0, 1), \"source\": "
                        f"text}}: {BY_HAND}")
    return Figure(float(frag["fraction"]), frag["source"])


def _figures(d: dict, origin: str) -> tuple[dict[str, Figure], Figure | None, Figure | None]:
    """The ``bandwidth_per`` and ``memory_fragmentation`` keys (module docstring), checked."""
    per = d.get("bandwidth_per", {})
    if not isinstance(per, dict) or any(t not in TIERS or not isinstance(v, dict) or v.get("per") not in PER
                                        or not isinstance(v.get("source"), str) for t, v in per.items()):
        raise UserError(f"{origin}: bandwidth_per is {_short(per)}; want tier -> {{\"per\": one of "
                        f"{', '.join(PER)}, \"source\": text}}: {BY_HAND}")
    frag = d.get("memory_fragmentation")
    expandable = frag.get("expandable_segments") if isinstance(frag, dict) else None
    if isinstance(frag, dict):
        frag = {k: v for k, v in frag.items() if k != "expandable_segments"}
    return ({t: Figure(v["per"], v["source"]) for t, v in per.items()},
            _fraction(frag, origin, "memory_fragmentation"),
            _fraction(expandable, origin, "memory_fragmentation.expandable_segments"))


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
    bandwidth_per: dict[str, Figure] = field(default_factory=dict)  # tier -> "gpu" or "node" (docstring)
    fragmentation: Figure | None = None  # the allocator's reserved-but-unallocated share at peak
    fragmentation_expandable: Figure | None = None  # the same under expandable segments, if measured
    module: ModuleSection | None = None  # the user's module timed on one GPU (``calibrate.module``), if measured
    residuals: Residuals | None = None  # measured / predicted step per apply path (``autotune tune``), if run

    @property
    def fragmentation_fraction(self) -> float:
        return DEFAULT_FRAGMENTATION if self.fragmentation is None else float(self.fragmentation.value)

    @property
    def memory_bytes(self) -> int | None:
        """Bytes a plan may allocate at its peak on one device: the usable memory (the device section) less the
        fragmentation allowance; None when not known."""
        return self.memory_bytes_under("default")

    def fragmentation_under(self, allocator: str) -> Figure | None:
        """The allowance stated for ``allocator`` (``ALLOCATORS``): None where the profile states none for it."""
        if allocator not in ALLOCATORS:
            raise UserError(f"allocator {allocator!r}: want one of {', '.join(ALLOCATORS)}")
        return self.fragmentation_expandable if allocator == "expandable_segments" else self.fragmentation

    def memory_bytes_under(self, allocator: str) -> int | None:
        """``memory_bytes`` for a job under ``allocator``: its allowance where the profile states one, else the
        default allocator's (the larger: expandable segments fragment less)."""
        if self.device is None:
            return None
        stated = self.fragmentation_under(allocator)
        frac = float(stated.value) if stated is not None else self.fragmentation_fraction
        return int(self.device.usable_bytes * (1 - frac))

    def for_model(self, config: dict) -> "Profile":
        """This profile as ``config``'s model is priced: where the module section was measured on that model with
        its slowdown beside collectives (``module.overlap``: the user's own kernels beside NCCL's), those figures in
        place of the compute section's (a stream of plain products beside them)."""
        m, c = self.module, self.compute
        if m is None or c is None or not m.overlap or not m.matches(config):
            return self
        return replace(self, compute=replace(c, overlap={**c.overlap, **m.overlap}))

    def per(self, tier: str) -> str:
        """Whether ``tier``'s bandwidth is each GPU's ("gpu") or the node's ("node", the default)."""
        scope = self.bandwidth_per.get(tier)
        return "node" if scope is None else str(scope.value)

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

    def time(self, coll: Collective | str, nbytes: float, group: Group, groups_per_node: int | None = None,
             gpus_per_node: int = 1) -> float:
        """Predicted seconds for one collective of ``nbytes`` (nccl-tests' size) on ``group``; with
        ``groups_per_node``, while that many such groups cross each node's network at once (module
        docstring), else as many as when the model was measured; a tier whose bandwidth is per GPU
        (``bandwidth_per``) counts a node of ``gpus_per_node`` GPUs as that many links."""
        if group.ranks == 1 or nbytes <= 0:
            return 0.0
        coll = Collective.parse(coll) if isinstance(coll, str) else coll
        model, p = self.model(coll, group)
        if groups_per_node is not None and group.nodes > 1:
            links = gpus_per_node if self.per(group.tier) == "gpu" else model.groups_per_node
            nbytes = nbytes * groups_per_node / links
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
            **({"bandwidth_per": {t: {"per": f.value, "source": f.source} for t, f in self.bandwidth_per.items()}}
               if self.bandwidth_per else {}),
            **({"memory_fragmentation": {
                "fraction": self.fragmentation.value, "source": self.fragmentation.source,
                **({"expandable_segments": {"fraction": self.fragmentation_expandable.value,
                                            "source": self.fragmentation_expandable.source}}
                   if self.fragmentation_expandable is not None else {})}}
               if self.fragmentation is not None else {}),
            **({"module": self.module.to_dict()} if self.module is not None else {}),
            **({"residuals": self.residuals.to_dict()} if self.residuals is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict, origin: str = "profile") -> "Profile":
        check_header(d, KIND, READ_VERSIONS, "commtune profile", REFIT, origin)
        for key in ("name", "provenance", "tiers"):
            if key not in d:
                raise UserError(f"{origin} lacks the field {key!r}: refit it with python -m calibrate fit")
        for key, kind in (("name", str), ("provenance", dict), ("hardware", dict), ("software", dict),
                          ("timing_mode", str)):
            if key in d and not isinstance(d[key], kind):
                raise UserError(f"{origin}: {key} is {_short(d[key])}, not {'a string' if kind is str else 'an object'}: "
                                f"fix it or {REFIT}")
        per, frag, expandable = _figures(d, origin)
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
                    where = f"{origin}: {tier}/{coll}/p={p}"
                    if not isinstance(m, dict) or not isinstance(m.get("segments", []), list):
                        raise UserError(f"{where} is not a model with a list of segments: "
                                        f"refit it with python -m calibrate fit")
                    segs = _segments(m.get("segments", []), where)
                    _check_model_fields(m, where)
                    tiers[tier][coll][str(p)] = CollectiveModel(
                        segs, m.get("points", []), m.get("validation", {}),
                        m.get("method", "segments"), m.get("switches", []), m.get("groups_per_node", 1))
        return cls(
            name=d["name"],
            provenance=d["provenance"],
            hardware=d.get("hardware", {}),
            software=d.get("software", {}),
            timing_mode=d.get("timing_mode", ""),
            tiers=tiers,
            compute=ComputeModel.from_dict(d["compute"], origin) if "compute" in d else None,
            device=Device.from_dict(d["device"], origin) if "device" in d else None,
            bandwidth_per=per, fragmentation=frag, fragmentation_expandable=expandable,
            module=ModuleSection.from_dict(d["module"], origin) if "module" in d else None,
            residuals=Residuals.from_dict(d["residuals"], origin) if "residuals" in d else None,
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


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _segments(raw: list, where: str) -> list[Segment]:
    """The segments of one model, each checked, in size order, none overlapping the next."""
    segs = sorted((_segment(s, where) for s in raw), key=lambda s: s.min_bytes)
    if not segs:
        raise UserError(f"{where} has no segments: {REFIT}")
    for a, b in zip(segs, segs[1:]):
        if b.min_bytes < a.max_bytes:
            raise UserError(f"{where}: segments [{a.min_bytes:.0f}, {a.max_bytes:.0f}) and [{b.min_bytes:.0f}, "
                            f"{b.max_bytes:.0f}) overlap: each segment must start where the one before ends; "
                            f"{REFIT}")
    return segs


def _segment(s, where: str) -> Segment:
    """A Segment from its JSON, every number checked to be a finite one in its range."""
    fields = ("min_bytes", "max_bytes", "alpha", "beta")
    if not isinstance(s, dict) or any(k not in s for k in fields) or set(s) - set(fields) - {"fit"}:
        raise UserError(f"{where}: a segment needs exactly {', '.join(fields)} (and fit): "
                        f"refit it with python -m calibrate fit")
    bad = [k for k in fields if not _is_number(s[k])]
    if bad:
        raise UserError(f"{where}: segment field {bad[0]} is {_short(s[bad[0]])}, not a number: "
                        f"fix it or refit with python -m calibrate fit")
    bad = [k for k in fields if not math.isfinite(s[k])]
    if bad:
        raise UserError(f"{where}: segment field {bad[0]} is {s[bad[0]]!r}, not a finite number: "
                        f"fix it or {REFIT}")
    lo, hi, alpha, beta = (float(s[k]) for k in fields)
    if not 0 <= lo < hi <= MAX_SEGMENT_BYTES:
        raise UserError(f"{where}: a segment spans [{lo:g}, {hi:g}) bytes; want 0 <= min_bytes < max_bytes <= "
                        f"2**62: fix it or {REFIT}")
    if not (0 <= alpha <= MAX_ALPHA_S and 0 <= beta <= MAX_BETA_S_PER_BYTE) or alpha == beta == 0:
        raise UserError(f"{where}: a segment has alpha {alpha:g} s and beta {beta:g} s/B; want alpha in [0, "
                        f"{MAX_ALPHA_S:g}] s, beta in [0, {MAX_BETA_S_PER_BYTE:g}] s/B, not both 0: "
                        f"fix it or {REFIT}")
    fit = s.get("fit", {})
    if not isinstance(fit, dict):
        raise UserError(f"{where}: a segment's fit is {_short(fit)}, not an object: fix it or {REFIT}")
    for key in ("first_bytes", "last_bytes"):
        if key in fit and not (_is_number(fit[key]) and 0 < fit[key] < math.inf):
            raise UserError(f"{where}: a segment's fit/{key} is {_short(fit[key])}; want a positive size in "
                            f"bytes: fix it or {REFIT}")
    if "first_bytes" in fit and "last_bytes" in fit and fit["first_bytes"] > fit["last_bytes"]:
        raise UserError(f"{where}: a segment's fit/first_bytes {fit['first_bytes']} is above its last_bytes "
                        f"{fit['last_bytes']}: fix it or {REFIT}")
    return Segment(lo, hi, alpha, beta, fit)


def _check_model_fields(m: dict, where: str) -> None:
    """The optional fields of a model have the shapes their readers (reports, validation) rely on."""
    points = m.get("points", [])
    if not isinstance(points, list) or not all(
            isinstance(pt, list) and len(pt) == 2 and all(_is_number(v) and math.isfinite(v) for v in pt)
            and pt[0] > 0 and pt[1] > 0 for pt in points):
        raise UserError(f"{where}: points is not a list of [bytes, seconds] pairs of positive numbers: "
                        f"fix it or {REFIT}")
    if not isinstance(m.get("validation", {}), dict):
        raise UserError(f"{where}: validation is {_short(m['validation'])}, not an object: fix it or {REFIT}")
    if m.get("method", "segments") not in METHODS:
        raise UserError(f"{where}: method is {_short(m['method'])}; want one of {', '.join(METHODS)}: "
                        f"fix it or {REFIT}")
    switches = m.get("switches", [])
    if not isinstance(switches, list) or not all(isinstance(x, dict) for x in switches):
        raise UserError(f"{where}: switches is not a list of objects: fix it or {REFIT}")
    k = m.get("groups_per_node", 1)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UserError(f"{where}: groups_per_node is {_short(k)}; want a whole number of groups, at least 1: "
                        f"fix it or {REFIT}")


def embedded_profile_names() -> list[str]:
    return sorted(
        f.name[:-5]
        for f in resources.files("calibrate.profiles").iterdir()
        if f.name.endswith(".json")
    )
