"""A profile's ``module`` section: the user's own transformer module timed on one GPU
(``python -m calibrate module``, ``calibrate.moduletime``), which the step model prefers to its
analytical prices wherever a measured point matches (``autotune.sbp.modulecal``).

Section shape (version 1)::

    "module": {
      "version": 1,
      "source": "python -m calibrate module on NVIDIA H200, torch 2.11, 2026-11-28T18:00",
      "module": "transformers:LlamaForCausalLM" | "pkg.mod:factory",
      "model": {"hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocabulary": 128256},
      "recipe": "fp32 weights, bf16 autocast, fused AdamW",
      "device": "NVIDIA H200",
      "points": [{"tensor": 1, "micro_batch": 2, "sequence": 2048,
                  "block":   {"forward_s": .., "backward_s": .., "recompute_s": .., "optimizer_s": ..,
                              "activation_bytes": .., "step_s": .., "forward_transient_bytes": ..},
                  "outside": {"forward_s": .., "backward_s": .., "optimizer_s": .., "activation_bytes": ..,
                              "step_s": .., "peak_bytes": ..}},
                 ...],
      "host_s": {"none": [per_pass, per_step], "ddp": [...], "fully_shard": [...]},
      "memory": {"fragmentation": 0.04, "path_bytes_per_param": {"ddp": 4.1, "fully_shard": 0.3},
                 "allocator": "default"},
      "overlap": {"all_reduce": 1.1, "all_gather": 1.2, "reduce_scatter": 1.2, "peer": "nccl"}
    }

A point is one local shape the search considers: the block built with heads, K/V heads and the MLP's
width divided by ``tensor`` (and the vocabulary by ``tensor``: a vocabulary-parallel embedding and
head), a local micro-batch of ``micro_batch`` sequences of ``sequence`` tokens. ``block`` is one
transformer block (a model of 1 + ``calibrate.usermodule.MORE`` blocks less one of one block, over ``MORE``,
so the embedding, the final norm, the head and the loss cancel): its forward, its backward (forward +
backward less forward, into fresh gradients), the forward that full recomputation re-runs in the backward
(``recompute_s``; null where the module could not be checkpointed) and its fused AdamW step;
``activation_bytes`` the memory one block keeps from its forward to its backward, autocast's bf16 weight
copies included (allocated after the larger model's forward less the one-block model's, per block; null off
CUDA); ``forward_transient_bytes`` what one block holds at the forward's end beyond that, freed when the model's
output is (a transformers model's key/value cache, built in training too while ``use_cache`` is on: one H200,
2026-11-29, 1.9 GiB over 16 Llama blocks), the larger model's peak over its forward less the one-block model's,
per block, less ``activation_bytes``. ``outside`` is the rest of the
one-block model (embedding, final norm, head, loss), its ``activation_bytes`` the one-block model's less the
block's (absent in sections written before it was measured: null). ``step_s`` (both): the step as users run
it, ``STEP_MICRO_BATCHES`` micro-batches accumulated and the optimizer's step back to back, of the larger model
less the one-block model's (the block) and the rest (outside): the parts timed alone need not add up to it, and the
step model keeps their proportions and takes its sum (``autotune.sbp.modulecal``). ``peak_bytes`` (outside;
null off CUDA): the one-block model's peak allocated over that step above its parameters and optimizer states
(its gradients, what it keeps and the transients: the loss's, the backward's), which the memory model's peak
is corrected by. ``host_s``: per apply path (``calibrate.compute.HOST_PATHS``), the host's seconds to issue one
block's forward and backward per micro-batch, and its optimizer step per step (the ``1 + MORE``-block model's
issue time less the one-block model's, over ``MORE``), measured in the same run on a process group of one (the
tensor-parallel paths among 2 GPUs where 2 are visible); ``host_outside_s``: for those paths
(``calibrate.compute.OUTSIDE_HOST_PATHS``), the same of the model outside its blocks (the one-block model's less a
block: its embedding and head split by vocabulary, its loss vocabulary-parallel). ``memory``
(CUDA only): the allocator's fragmentation (the step's peak reserved over its peak allocated, less 1, on the
"none" path), under ``allocator`` (``calibrate.allocator``: the process's setting), which the search keeps as
an allowance under the device's limit for plans searched for that allocator (``autotune.cli.search.
memory_limit``), and per path the bytes per parameter its placement allocates beyond the plain module's at the
step's peak (DDP's buckets and first-step copies, fully_shard's copy-in/out; recorded for the memory model).
``overlap`` (where 2 GPUs were visible): the model's forward and backward beside each collective over it alone
(``calibrate.overlap``: collectives of one block's fp32 parameters between 2 GPUs), which the search takes in place
of the compute section's figures for this model (``calibrate.profile.Profile.for_model``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from calibrate.allocator import ALLOCATORS
from calibrate.compute import HOST_PATHS, OUTSIDE_WHAT, host_figures, overlap_figures
from calibrate.errors import UserError

VERSION = 1
MODEL_KEYS = ("hidden", "heads", "kv_heads", "ffn", "vocabulary")
BLOCK_KEYS = ("forward_s", "backward_s", "recompute_s", "optimizer_s", "activation_bytes", "step_s",
              "forward_transient_bytes")
OUTSIDE_KEYS = ("forward_s", "backward_s", "optimizer_s", "activation_bytes", "step_s", "peak_bytes")
OPTIONAL = ("recompute_s", "activation_bytes", "step_s", "peak_bytes", "forward_transient_bytes")  # null: not measured
LATER = ("activation_bytes", "step_s", "peak_bytes", "forward_transient_bytes")  # absent from sections written before they were: null
STEP_MICRO_BATCHES = 2  # micro-batches of the step arm (``step_s``)
DEFAULT_SEQUENCE = 4096  # a config.json's sequence where none is given (``default_sequence``)


def default_sequence(cfg: dict) -> int:
    """A model's sequence where none is given: its own, else ``DEFAULT_SEQUENCE`` at most its config's
    max_position_embeddings (GPT-2: n_positions). What the search takes for a config.json (``models.hf``), and so
    what ``calibrate module`` times by default."""
    return int(cfg.get("sequence") or min(DEFAULT_SEQUENCE, int(cfg.get("max_position_embeddings")
                                                              or cfg.get("n_positions") or DEFAULT_SEQUENCE)))


FIX = "re-run python -m calibrate module"


def _number(v, optional: bool) -> bool:
    if v is None:
        return optional
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


@dataclass(frozen=True)
class ModulePoint:
    """One measured local shape (module docstring)."""

    tensor: int
    micro_batch: int
    sequence: int
    block: dict  # BLOCK_KEYS -> seconds (bytes), None where not measured
    outside: dict  # OUTSIDE_KEYS -> seconds

    @property
    def key(self) -> tuple[int, int, int]:
        return self.tensor, self.micro_batch, self.sequence

    def to_dict(self) -> dict:
        return {"tensor": self.tensor, "micro_batch": self.micro_batch, "sequence": self.sequence,
                "block": dict(self.block), "outside": dict(self.outside)}


@dataclass(frozen=True)
class ModuleSection:
    source: str
    module: str
    model: dict  # MODEL_KEYS -> int: the global shape the points were built from
    points: tuple[ModulePoint, ...]
    recipe: str = "fp32 weights, bf16 autocast, fused AdamW"
    device: str = ""
    host_s: dict = field(default_factory=dict)  # path -> (per block and micro-batch, per block and step)
    host_outside_s: dict = field(default_factory=dict)  # path -> (per micro-batch, per step) outside the blocks
    memory: dict = field(default_factory=dict)  # "fragmentation", "path_bytes_per_param" (module docstring)
    overlap: dict = field(default_factory=dict)  # collective -> the module's slowdown beside it, "peer" (docstring)

    def matches(self, config: dict) -> bool:
        """Whether the section was measured on the model of ``config`` (a model's transformer fields)."""
        return all(config.get(k, config.get("heads") if k == "kv_heads" else None) == v
                   for k, v in self.model.items())

    def point(self, tensor: int, micro_batch: int, sequence: int) -> ModulePoint | None:
        """The point of this tensor width and sequence whose micro-batch is nearest on a log scale (the
        larger on a tie); None where no point has the width and the sequence."""
        same = [p for p in self.points if p.tensor == tensor and p.sequence == sequence]
        if not same or micro_batch < 1:
            return None
        return min(same, key=lambda p: (abs(math.log(p.micro_batch / micro_batch)), -p.micro_batch))

    def to_dict(self) -> dict:
        return {"version": VERSION, "source": self.source, "module": self.module, "model": dict(self.model),
                "recipe": self.recipe, "device": self.device, "points": [p.to_dict() for p in self.points],
                **({"host_s": {k: list(v) for k, v in self.host_s.items()}} if self.host_s else {}),
                **({"host_outside_s": {k: list(v) for k, v in self.host_outside_s.items()}}
                   if self.host_outside_s else {}),
                **({"memory": self.memory} if self.memory else {}),
                **({"overlap": dict(self.overlap)} if self.overlap else {})}

    @classmethod
    def from_dict(cls, d, origin: str = "profile") -> "ModuleSection":
        where = f"{origin}: module section"
        if not isinstance(d, dict) or d.get("version") != VERSION:
            raise UserError(f"{where} is not a version-{VERSION} object: {FIX}")
        for key in ("source", "module", "recipe", "device"):
            if not isinstance(d.get(key, ""), str):
                raise UserError(f"{where}: {key} is not text: {FIX}")
        model = d.get("model")
        if not isinstance(model, dict) or set(model) != set(MODEL_KEYS) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in model.values()):
            raise UserError(f"{where}: model needs exactly {', '.join(MODEL_KEYS)} as positive integers: {FIX}")
        raw = d.get("points")
        if not isinstance(raw, list) or not raw:
            raise UserError(f"{where} has no points: {FIX}")
        points, seen = [], set()
        for p in raw:
            if isinstance(p, dict) and all(isinstance(p.get(k), dict) for k in ("block", "outside")):
                p = dict(p, **{k: {**{x: None for x in LATER if x in keys}, **p[k]}
                               for k, keys in (("block", BLOCK_KEYS), ("outside", OUTSIDE_KEYS))})
            ok = isinstance(p, dict) and all(isinstance(p.get(k), int) and not isinstance(p.get(k), bool)
                                             and p[k] > 0 for k in ("tensor", "micro_batch", "sequence"))
            ok = ok and all(isinstance(p.get(s), dict) and set(p[s]) == set(keys) and all(
                _number(p[s][k], k in OPTIONAL) for k in keys)
                for s, keys in (("block", BLOCK_KEYS), ("outside", OUTSIDE_KEYS)))
            if not ok:
                raise UserError(f"{where} has a bad point {str(p)[:120]!r} (want positive integer tensor, "
                                f"micro_batch, sequence; block {', '.join(BLOCK_KEYS)} and outside "
                                f"{', '.join(OUTSIDE_KEYS)}, non-negative numbers, {' and '.join(OPTIONAL)} "
                                f"may be null): {FIX}")
            point = ModulePoint(p["tensor"], p["micro_batch"], p["sequence"], dict(p["block"]), dict(p["outside"]))
            if point.key in seen:
                raise UserError(f"{where} has two points of tensor {point.tensor}, micro_batch "
                                f"{point.micro_batch}, sequence {point.sequence}: {FIX}")
            seen.add(point.key)
            points.append(point)
        host = d.get("host_s") or {}
        if not isinstance(host, dict) or any(
                k not in HOST_PATHS or not isinstance(v, list) or len(v) != 2 or not all(_number(x, False)
                                                                                   for x in v)
                for k, v in host.items()):
            raise UserError(f"{where} has a bad host_s (want path -> [per pass, per step] seconds, paths of "
                            f"{', '.join(HOST_PATHS)}): {FIX}")
        memory = d.get("memory") or {}
        per = memory.get("path_bytes_per_param", {}) if isinstance(memory, dict) else None
        if not isinstance(memory, dict) or set(memory) - {"fragmentation", "path_bytes_per_param", "allocator"} \
                or memory.get("allocator", "default") not in ALLOCATORS or not _number(
                memory.get("fragmentation", 0.0), False) or memory.get("fragmentation", 0.0) > 1 or not isinstance(
                per, dict) or any(k not in HOST_PATHS or not isinstance(v, (int, float)) or isinstance(v, bool)
                                  or not math.isfinite(v) for k, v in per.items()):
            raise UserError(f"{where} has a bad memory (want fragmentation in [0, 1], path_bytes_per_param: path -> "
                            f"bytes, and the allocator it was measured under, one of {', '.join(ALLOCATORS)}): {FIX}")
        return cls(d.get("source", ""), d["module"], dict(model), tuple(points), d.get("recipe", ""),
                   d.get("device", ""), {k: (float(v[0]), float(v[1])) for k, v in host.items()},
                   host_figures(d.get("host_outside_s"), where, OUTSIDE_WHAT), dict(memory),
                   overlap_figures(d.get("overlap"), where, FIX + " on 2 or more GPUs"))
