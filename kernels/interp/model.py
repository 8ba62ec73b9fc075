"""Cost model of a GC3 program as this interpreter runs it, next to what it models (the
schedule autotuner ranks candidates with it).

Derived from the runtime's structure and fitted to measurements (the papers give no formula):
- The interpreter runs each IR thread block as ``split`` CUDA blocks, block j moving the
  j-th 1/split of every chunk (runtime.py), tile by tile; ``pack.launch_geometry`` (which
  the runtime launches with) gives the tile: ``pack.tile_elems`` elements of each chunk
  piece (the FIFO slot, LL carrying 8 data bytes per 16-byte line, capped by the entry's
  ``tile_bytes``), and the split the runtime picks (``runtime_split``).
- One CUDA block pays, per tile of every step, a fixed cost ``tile_us`` (Simple: the
  flag written after the data and the fence that releases the slot; LL: the slot's
  head/tail bookkeeping) and streams its bytes at ``block_gbs``. Its time is
  ``tiles * tile_us + bytes / block_gbs``; the slowest block of the program counts
  (``Features.block_bytes``, ``Features.block_tiles``: the busiest IR thread block's
  share of one CUDA block).
- The link: the busiest directed link carries ``link_bytes`` at the link's asymptotic
  bandwidth (the last segment of the profile's intra-node sendrecv fit: pipelined tiles
  inside one kernel pay the link's rate, not NCCL's per-call small-message one), LL at
  half rate (``PROTOCOL_EFFICIENCY``).
- Latency: ``launch_us`` per protocol (the launch, the interpreter's table walk and, for
  Simple, the flag round trip of a program's last tile), plus ``hop_us`` per dependent
  message after the first (``Features.hops``: the longest chain of messages).
- An in-place program serving an out-of-place call first copies the input
  (``copy_bytes``) at the simulation's local rate (``LOCAL_BETA_FRACTION`` of the link's beta).

- Each CUDA block of the launch costs ``grid_block_us`` (``Features.blocks``: thread blocks x
  split on the busiest rank): at small sizes more blocks are slower, not faster (measured
  2026-11-22: Simple at 16 KiB, 8 blocks per thread block 6.70 us against 1 block 6.45 us).

  t = launch_us[p] + (hops - 1) hop_us + link_bytes / (link_bw eff[p]) + copy
      + block_tiles tile_us[p] + block_bytes / block_gbs[p] + blocks grid_block_us[p]

The per-protocol terms are linear in (launch_us, tile_us, 1 / block_gbs, grid_block_us), and
hop_us is one more column where the samples include programs of several hops: ``fit`` solves
them by non-negative least squares on relative error. The shipped parameters
(fitted/interp_model.json) are fitted on the interpreter's forced-configuration sweep named
in their provenance (python -m kernels bench --sweep model, 2 x H200; see
reports/records/schedule.md), a different run from any schedule tuning, so ranking a
schedule run's measured candidates with them uses none of that run's measurements.
Where a sweep has only one-hop programs, ``hop_us`` is the one-block LL allreduce ceiling less
an empty graph kernel node of the same record.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibrate.collectives import Collective
from calibrate.errors import UserError
from calibrate.jsonfile import read_named_json
from calibrate.records import check_header, header
from calibrate.profile import Group, Profile
from kernels.gc3.compiler import compile_algorithm
from kernels.gc3.ir import Program, Protocol
from kernels.gc3.simulate import LOCAL_BETA_FRACTION, PROTOCOL_EFFICIENCY, message_partners
from kernels.gc3.xml_io import read_xml
from kernels.interp import pack
from kernels.interp.preset import PROGRAM_DIR, Fifo
from kernels.interp.records import SweepRecord

KIND = "commtune.interp-model"
VERSION = 1
PARAMS_DIR = Path(__file__).parent / "fitted"
DEFAULT_PARAMS = "interp_model"
REFIT = "refit them with python -m autotune schedule --fit-model"


@dataclass(frozen=True)
class Features:
    """What the model needs of one program at one size, split and tile."""

    hops: int
    link_bytes: float           # the busiest directed link within a node
    inter_link_bytes: float     # the busiest directed link between nodes
    block_bytes: float
    block_tiles: int
    copy_bytes: float
    blocks: int = 1             # CUDA blocks of the launch on the busiest rank (thread blocks x split)


@dataclass(frozen=True)
class ProtocolParams:
    launch_us: float
    tile_us: float
    block_gbs: float
    grid_block_us: float = 0.0  # per CUDA block of the launch (0 in parameters fitted before it existed)


@dataclass
class ModelParams:
    protocols: dict[str, ProtocolParams]
    hop_us: float
    provenance: dict = field(default_factory=dict)

    def for_protocol(self, protocol: str) -> ProtocolParams:
        if protocol not in self.protocols:
            raise UserError(f"the interpreter model has no parameters for protocol {protocol}; refit it with "
                            f"python -m autotune schedule --fit-model on measurements that include it")
        return self.protocols[protocol]

    def to_json(self) -> dict:
        return {**header(KIND, VERSION), "hop_us": self.hop_us,
                "protocols": {p: dataclasses.asdict(v) for p, v in sorted(self.protocols.items())},
                "provenance": self.provenance}

    @classmethod
    def from_json(cls, data: dict, name: str = "") -> "ModelParams":
        # parameters written before the header have no kind
        check_header(data, KIND, VERSION, "interpreter model parameters", REFIT, repr(name), (None,))
        try:
            protos = {str(p): ProtocolParams(float(v["launch_us"]), float(v["tile_us"]), float(v["block_gbs"]),
                                             float(v.get("grid_block_us", 0.0)))
                      for p, v in data["protocols"].items()}
            params = cls(protos, float(data["hop_us"]), dict(data.get("provenance", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"interpreter model parameters {name!r} are malformed ({e!r}); compare them with "
                            f"kernels/interp/fitted/{DEFAULT_PARAMS}.json") from None
        if any(v.block_gbs <= 0 or min(v.launch_us, v.tile_us, v.grid_block_us) < 0
               for v in protos.values()) or params.hop_us < 0:
            raise UserError(f"interpreter model parameters {name!r}: block_gbs must be > 0 and times >= 0")
        return params


def load_params(name_or_path: str = DEFAULT_PARAMS) -> ModelParams:
    data, name = read_named_json(name_or_path, PARAMS_DIR, "interpreter model parameters")
    return ModelParams.from_json(data, name)


def runtime_split(program: Program, nbytes: int, esize: int, bytes_per_block: int, max_split: int) -> int:
    """CUDA blocks per IR thread block that the interpreter uses at this size."""
    chunk_bytes = max(esize, nbytes // program.nchunksperloop)
    return pack.split_for(chunk_bytes, bytes_per_block, max_split)


def copy_bytes(program: Program, nbytes: int) -> int:
    """Bytes copied before an out-of-place call served by an in-place ``program``."""
    if not program.inplace:
        return 0
    if program.collective == "allreduce":
        return nbytes
    if program.collective == "allgather":
        return nbytes // program.ngpus
    return 0


def hops(program: Program) -> int:
    """The longest chain of dependent messages (a send and its matching receive is one)."""
    partner = message_partners(program)
    preds: dict[tuple[int, int, int], list[tuple[tuple[int, int, int], int]]] = {}
    for g in program.gpus:
        for tb in g.threadblocks:
            for i, st in enumerate(tb.steps):
                n = (g.id, tb.id, i)
                p = ([((g.id, tb.id, i - 1), 0)] if i > 0 else []) + [((g.id, d[0], d[1]), 0) for d in st.deps]
                if n in partner:
                    p.append((partner[n], 1))
                preds[n] = p
    succ = defaultdict(list)
    for n, ps in preds.items():
        for q, w in ps:
            succ[q].append((n, w))
    missing = {n: len(ps) for n, ps in preds.items()}
    depth = {n: 0 for n in preds}
    ready = [n for n, k in missing.items() if k == 0]
    done = 0
    while ready:
        n = ready.pop()
        done += 1
        for s, w in succ[n]:
            depth[s] = max(depth[s], depth[n] + w)
            missing[s] -= 1
            if missing[s] == 0:
                ready.append(s)
    if done != len(preds):
        raise UserError(f"program {program.name!r} has a dependency cycle; run kernels check on it")
    return max(list(depth.values()) + [1])


def features(program: Program, nbytes: int, split: int, tile_bytes: int, fifo: dict[Protocol, Fifo],
             esize: int, gpus_per_node: int = 0) -> Features:
    """Features of ``program`` (protocol set) moving a collective of ``nbytes`` with ``split`` CUDA
    blocks per thread block and the entry's tile cap; ``gpus_per_node`` 0: all on one node."""
    per_node = gpus_per_node or program.ngpus
    chunk = nbytes / program.nchunksperloop
    max_cnt = max((st.cnt for g in program.gpus for tb in g.threadblocks for st in tb.steps), default=1)
    geo = pack.launch_geometry(program.protocol, esize, fifo[program.protocol].slot_bytes, max_cnt,
                               max(len(g.threadblocks) for g in program.gpus), split, tile_bytes)
    piece_tiles = geo.piece_tiles(chunk)
    link: dict[tuple[int, int], float] = defaultdict(float)
    block = (0.0, 0)
    for g in program.gpus:
        for tb in g.threadblocks:
            moved = sum(st.cnt for st in tb.steps) * chunk / split
            tiles = sum(piece_tiles for st in tb.steps if st.cnt > 0)
            block = max(block, (moved, tiles))
            for st in tb.steps:
                if st.type.sends:
                    link[(g.id, tb.send)] += st.cnt * chunk
    intra = [b for (a, c), b in link.items() if a // per_node == c // per_node]
    inter = [b for (a, c), b in link.items() if a // per_node != c // per_node]
    return Features(hops(program), max(intra, default=0.0), max(inter, default=0.0), block[0], block[1],
                    copy_bytes(program, nbytes), geo.blocks)


@dataclass(frozen=True)
class Links:
    """Seconds per byte of a link at its asymptote, within a node and between nodes: the last
    segment of the profile's sendrecv fit on each tier."""

    intra_beta: float
    inter_beta: float

    @classmethod
    def from_profile(cls, profile: Profile) -> "Links":
        betas = []
        for nodes in (1, 2):
            model, _ = profile.model(Collective.SENDRECV, Group(2, nodes))
            betas.append(model.segments[-1].beta)
        return cls(*betas)


def fixed_seconds(f: Features, protocol: Protocol, links: Links, hop_s: float) -> float:
    """The parameter-free part: the busiest link, the input copy and the hops after the first."""
    link = max(f.link_bytes * links.intra_beta, f.inter_link_bytes * links.inter_beta)
    return (link / PROTOCOL_EFFICIENCY[protocol] + f.copy_bytes * links.intra_beta * LOCAL_BETA_FRACTION
            + (f.hops - 1) * hop_s)


def predict(f: Features, protocol: Protocol, params: ModelParams, links: Links) -> float:
    """Predicted seconds."""
    p = params.for_protocol(protocol.value)
    return (fixed_seconds(f, protocol, links, params.hop_us * 1e-6) + p.launch_us * 1e-6
            + f.block_tiles * p.tile_us * 1e-6 + f.block_bytes / (p.block_gbs * 1e9) + f.blocks * p.grid_block_us * 1e-6)


@dataclass(frozen=True)
class Sample:
    """One measured configuration: a program run with a protocol, split and tile at a size."""

    program: Program
    protocol: Protocol
    nbytes: int
    split: int
    tile_bytes: int
    seconds: float


def fit(samples: list[Sample], fifo: dict[Protocol, Fifo], esize: int, links: Links, hop_us: float,
        provenance: dict | None = None) -> ModelParams:
    """Per protocol (launch_us, tile_us, block_gbs, grid_block_us), by non-negative least squares on relative error
    (a protocol needs 3 samples). ``hop_us`` is fitted with them, one value for every protocol, when
    some sample's program has more than one hop; otherwise the given value is kept."""
    from scipy.optimize import nnls

    usable = [s for s in samples if s.seconds > 0]
    protos = [p for p in sorted({s.protocol for s in usable}, key=lambda p: p.value)
              if sum(s.protocol == p for s in usable) >= 3]
    if not protos:
        raise UserError("no protocol has 3 measured samples; the interpreter model cannot be fitted")
    feats = [(s, features(dataclasses.replace(s.program, protocol=s.protocol), s.nbytes, s.split, s.tile_bytes,
                          fifo, esize)) for s in usable if s.protocol in protos]
    fit_hop = any(f.hops > 1 for _, f in feats)
    ncol = 4 * len(protos) + (1 if fit_hop else 0)
    rows, ys = [], []
    for s, f in feats:
        row = [0.0] * ncol
        k = 4 * protos.index(s.protocol)
        row[k:k + 4] = [1.0 / s.seconds, f.block_tiles / s.seconds, f.block_bytes / s.seconds, f.blocks / s.seconds]
        if fit_hop:
            row[-1] = (f.hops - 1) / s.seconds
        rest = s.seconds - fixed_seconds(f, s.protocol, links, 0.0 if fit_hop else hop_us * 1e-6)
        rows.append(row)
        ys.append(rest / s.seconds)
    sol, _ = nnls(np.array(rows), np.array(ys))
    out = {}
    for i, proto in enumerate(protos):
        launch, tile, inv_bw, per_block = sol[4 * i:4 * i + 4]
        out[proto.value] = ProtocolParams(float(launch) * 1e6, float(tile) * 1e6, 1e-9 / max(float(inv_bw), 1e-15),
                                          float(per_block) * 1e6)
    return ModelParams(out, round(float(sol[-1]) * 1e6, 3) if fit_hop else hop_us, provenance or {})


def load_tune_record(path: str | Path) -> SweepRecord:
    """An interpreter sweep record (``python -m kernels bench --sweep``)."""
    return SweepRecord.load(path)


def tune_samples(record: SweepRecord, threads: int = 512, reference_dir: Path | None = None) -> list[Sample]:
    """The correct float32 rows of an interpreter sweep record (``load_tune_record``) run with the
    preset's transport (its ``threads``, variant "base") and a shipped program, a library program
    (``algorithm``, compiled again for the row's ``nranks``) or, in older records, a reference MSCCL
    program (``program_file``: read from ``reference_dir`` when given, else the row is left out)."""
    programs: dict[str, Program] = {}
    out = []
    for run in record.runs:
        for r in run.get("rows", []):
            if (r.get("threads") != threads or not r.get("correct") or r.get("variant", "base") != "base"
                    or r.get("dtype", "float32") != "float32"):
                continue
            name = r["program"]
            if r.get("algorithm"):
                name = f"{r['algorithm']}@{r.get('nranks', 2)}"
                if name not in programs:
                    programs[name] = compile_algorithm(r["algorithm"], int(r.get("nranks", 2)))
            elif name not in programs:
                path_xml = PROGRAM_DIR / f"{name}.xml"
                if r.get("program_file"):  # a reference MSCCL program an older sweep ran (multi-hop)
                    if reference_dir is None:
                        continue
                    path_xml = Path(reference_dir) / r["program_file"]
                if not path_xml.is_file():
                    continue
                programs[name] = read_xml(path_xml)
            out.append(Sample(programs[name], Protocol(r["protocol"]), int(r["bytes"]), int(r["split"]),
                              int(r.get("tile_bytes", 0)), float(r["interp_us"]) * 1e-6))
    return out
