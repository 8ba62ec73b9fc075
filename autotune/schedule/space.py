"""The search space (a data file in presets/) and the candidates it spans.

A candidate is one program (an algorithm of the GC3 library compiled with a
number of channels and instances, or a program file the interpreter ships) run
with one protocol and one CUDA-block setting of the interpreter
(``bytes_per_block``, ``max_split``: how many CUDA blocks share each IR thread
block). Candidates whose compiled programs are identical (up to the name) are
enumerated once; algorithms that do not apply to the communicator (e.g.
hierarchical allreduce on one node) and protocols the interpreter does not
implement are skipped with a note.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from calibrate.errors import UserError
from calibrate.records import check_header
from calibrate.jsonfile import read_named_json
from kernels.gc3.algorithms import ALGORITHMS, build
from kernels.gc3.compiler import compile_program
from kernels.gc3.ir import Program, Protocol
from kernels.gc3.xml_io import read_xml, write_xml
from kernels.interp import pack
from kernels.interp.preset import PROGRAM_DIR

KIND = "commtune.schedule-space"
VERSION = 1
PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_SPACE = "spaces"


@dataclass(frozen=True)
class Candidate:
    algorithm: str          # a GC3 library algorithm, or a program file name
    source: str             # "library" | "file"
    channels: int
    instances: int
    protocol: str           # Protocol value
    bytes_per_block: int
    max_split: int
    tile_bytes: int = 0

    @property
    def key(self) -> str:
        shape = f"c{self.channels}i{self.instances}" if self.source == "library" else "file"
        tile = f"/t{self.tile_bytes // 1024}K" if self.tile_bytes else ""
        return f"{self.algorithm}/{shape}/{self.protocol}/b{self.bytes_per_block // 1024}Kx{self.max_split}{tile}"

    @property
    def program_key(self) -> tuple:
        """What fixes the program (everything but the runtime's block setting)."""
        return (self.algorithm, self.source, self.channels, self.instances, self.protocol)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Candidate":
        return cls(**d)


@dataclass
class Built:
    candidate: Candidate
    program: Program        # compiled, protocol set, no size range


@dataclass(frozen=True)
class SearchSpace:
    name: str
    channels: tuple[int, ...]
    instances: tuple[int, ...]
    protocols: tuple[str, ...]
    blocks: tuple[tuple[int, int], ...]          # (bytes_per_block, max_split)
    tile_bytes: dict                             # protocol -> tile caps to try (0: the slot decides)
    collectives: dict                            # collective -> {"algorithms": [...], "programs": [...]}
    nccl_algorithm: dict                         # library algorithm -> NCCL tuner algorithm name

    @classmethod
    def from_json(cls, data: dict, name: str) -> "SearchSpace":
        check_header(data, KIND, VERSION, "search space", "update the file", repr(name), (None,))
        try:
            space = cls(name=name, channels=tuple(int(c) for c in data["channels"]),
                        instances=tuple(int(i) for i in data["instances"]),
                        protocols=tuple(str(p) for p in data["protocols"]),
                        blocks=tuple((int(b["bytes_per_block"]), int(b["max_split"])) for b in data["blocks"]),
                        tile_bytes={str(k): tuple(int(t) for t in (v if isinstance(v, list) else [v]))
                                    for k, v in data.get("tile_bytes", {}).items()},
                        collectives={str(k): {"algorithms": list(v.get("algorithms", [])),
                                              "programs": list(v.get("programs", []))}
                                     for k, v in data["collectives"].items()},
                        nccl_algorithm={str(k): str(v) for k, v in data.get("nccl_algorithm", {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"search space {name!r} is malformed ({e!r}); compare it with "
                            f"autotune/schedule/presets/{DEFAULT_SPACE}.json") from None
        space.validate()
        return space

    def validate(self) -> None:
        if not self.channels or min(self.channels) < 1 or not self.instances or min(self.instances) < 1:
            raise UserError(f"search space {self.name!r}: channels and instances need values >= 1")
        if any(not v or min(v) < 0 for v in self.tile_bytes.values()):
            raise UserError(f"search space {self.name!r}: tile_bytes needs, per protocol, a list of sizes >= 0")
        if not self.blocks or any(b < 256 or s < 1 for b, s in self.blocks):
            raise UserError(f"search space {self.name!r}: blocks need bytes_per_block >= 256 and max_split >= 1")
        for p in self.protocols:
            if p not in {x.value for x in Protocol}:
                raise UserError(f"search space {self.name!r}: unknown protocol {p!r}; use Simple, LL or LL128")
        for coll, v in self.collectives.items():
            for alg in v["algorithms"]:
                if alg not in ALGORITHMS:
                    raise UserError(f"search space {self.name!r}: {coll} lists unknown algorithm {alg!r}; "
                                    f"choose from {', '.join(sorted(ALGORITHMS))}")


def load_space(name_or_path: str = DEFAULT_SPACE) -> SearchSpace:
    data, name = read_named_json(name_or_path, PRESET_DIR, "search space")
    return SearchSpace.from_json(data, name=name)


def _fingerprint(program: Program) -> str:
    return write_xml(dataclasses.replace(program, name="", protocol=Protocol.SIMPLE))


def _program_file(name: str) -> Path:
    p = Path(name)
    return p if p.is_file() else PROGRAM_DIR / name


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def out_of_place_ok(program: Program) -> bool:
    """Whether the interpreter can serve an out-of-place call (NCCL's usual one) with ``program``:
    it emulates it for in-place allreduce and allgather programs with one copy of the input first
    (kernels.interp.runtime), and refuses it otherwise."""
    return not program.inplace or program.collective in ("allreduce", "allgather")


def _programs(space: SearchSpace, collective: str, ranks: int, nodes: int, notes: list[str]):
    """(algorithm, source, channels, instances, protocol-free program) of the space, deduplicated."""
    if collective not in space.collectives:
        raise UserError(f"search space {space.name!r} has nothing for {collective!r}; tune one of "
                        f"{', '.join(space.collectives)} or add it to the space")
    entry = space.collectives[collective]
    seen: dict[str, str] = {}
    out = []

    def admit(name: str, label: str, program: Program, row: tuple) -> None:
        """``row`` enumerated unless its program is for another collective (refused), for other ranks, in place
        (calls are out of place) or one already enumerated (each noted)."""
        if program.collective != collective:
            raise UserError(f"search space {space.name!r} lists {name} (a {program.collective}) under {collective}; "
                            f"move it")
        if program.ngpus != ranks:
            _note(notes, f"{name} skipped: it is for {program.ngpus} ranks, not {ranks}")
        elif not out_of_place_ok(program):
            _note(notes, f"{name} skipped: an in-place {collective} cannot serve out-of-place calls")
        elif (fp := _fingerprint(program)) in seen:
            notes.append(f"{label}: the same program as {seen[fp]}, enumerated once")
        else:
            seen[fp] = label
            out.append(row)

    for alg in entry["algorithms"]:
        for ch in space.channels:
            for inst in space.instances:
                try:
                    program = compile_program(build(alg, ranks, ch, inst, Protocol.SIMPLE, nodes))
                except UserError as e:
                    _note(notes, f"{alg} skipped: {e}")
                    continue
                admit(alg, f"{alg} c{ch}i{inst}", program, (alg, "library", ch, inst, program))
    for name in entry["programs"]:
        path = _program_file(name)
        if not path.is_file():
            raise UserError(f"search space {space.name!r}: program file {name!r} not found (looked in "
                            f"{PROGRAM_DIR}); fix the name")
        program = read_xml(path)
        admit(name, name, program, (path.name, "file", program.nchannels, 1, program))
    return out


def enumerate_candidates(space: SearchSpace, collective: str, ranks: int, nodes: int = 1) -> tuple[list[Built], list[str]]:
    """Every distinct candidate of ``space`` for ``collective`` on ``ranks`` ranks over ``nodes`` nodes,
    and notes on what was skipped and why."""
    notes: list[str] = []
    protocols = []
    for p in space.protocols:
        if Protocol(p) in pack.VALIDATED_PROTOCOLS:
            protocols.append(p)
        else:
            notes.append(f"protocol {p} skipped: the interpreter cost model has no parameters for it yet")
    built = []
    for alg, source, ch, inst, program in _programs(space, collective, ranks, nodes, notes):
        for proto in protocols:
            prog = dataclasses.replace(program, protocol=Protocol(proto))
            for bpb, split in space.blocks:
                for tile in space.tile_bytes.get(proto, (0,)):
                    built.append(Built(Candidate(alg, source, ch, inst, proto, bpb, split, tile), prog))
    if not built:
        raise UserError(f"no candidate of search space {space.name!r} applies to {collective} on {ranks} ranks "
                        f"over {nodes} node(s): " + "; ".join(notes[:3]))
    return built, notes


def build_candidate(c: Candidate, ranks: int, nodes: int = 1) -> Built:
    """The program of a recorded candidate, compiled again (library) or read again (file)."""
    if c.source == "file":
        path = _program_file(c.algorithm)
        if not path.is_file():
            raise UserError(f"program file {c.algorithm!r} of a recorded candidate not found in {PROGRAM_DIR}; "
                            f"restore it or rerun the tuner")
        program = read_xml(path)
    elif c.algorithm in ALGORITHMS:
        program = compile_program(build(c.algorithm, ranks, c.channels, c.instances, Protocol.SIMPLE, nodes))
    else:
        raise UserError(f"recorded candidate {c.key} names unknown algorithm {c.algorithm!r}; rerun the tuner")
    return Built(c, dataclasses.replace(program, protocol=Protocol(c.protocol)))


def build_variant(c: Candidate, collective: str, ranks: int, nodes: int = 1) -> Built:
    """A candidate outside the enumerated space (a knob of one candidate set as another has it), built
    when the interpreter can run it; a ``UserError`` saying why it cannot otherwise: a protocol it does
    not implement, a program that does not build (a channel or instance count the algorithm cannot
    take), one for another collective or number of ranks, or an in-place one that cannot serve
    out-of-place calls."""
    if Protocol(c.protocol) not in pack.VALIDATED_PROTOCOLS:
        raise UserError(f"{c.key}: the interpreter does not run protocol {c.protocol}")
    try:
        b = build_candidate(c, ranks, nodes)
    except UserError as e:
        raise UserError(f"{c.key} does not build: {e}") from None
    p = b.program
    if p.collective != collective:
        raise UserError(f"{c.key} is a {p.collective}, not a {collective}")
    if p.ngpus != ranks:
        raise UserError(f"{c.key} is for {p.ngpus} ranks, not {ranks}")
    if not out_of_place_ok(p):
        raise UserError(f"{c.key}: an in-place {collective} cannot serve out-of-place calls")
    return b
