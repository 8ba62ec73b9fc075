"""Presets of the interpreter runtime, kept as JSON data files in kernels/interp/presets:
the transport (FIFO slots per protocol, threads per block, channel and split limits)
and the programs to load with the size range each serves.

A preset is a tuned table for one rank count and one GPU: the schedule tuner writes one for
the machine it runs on (``TUNE_COMMAND``). An entry's program is an MSCCL XML file (beside
the preset, or in kernels/interp/programs) or the name of a GC3 library algorithm
(kernels.gc3.algorithms, e.g. ``direct_allreduce``), compiled for the communicator's rank
count by the project's compiler."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from calibrate.errors import UserError
from calibrate.records import check_header, header
from calibrate.jsonfile import read_named_json
from kernels.gc3.algorithms import ALGORITHMS
from kernels.gc3.compiler import compile_algorithm
from kernels.gc3.ir import Program, Protocol
from kernels.gc3.xml_io import read_xml

KIND = "commtune.interp-preset"
VERSION = 1
PRESET_DIR = Path(__file__).parent / "presets"
PROGRAM_DIR = Path(__file__).parent / "programs"
DEFAULT_PRESET = "h200x2"
TUNE_COMMAND = ("mpiexec -n {n} python -m autotune schedule --gpus {n} --collective allreduce,allgather,reducescatter "
                "--out tuned-{n}r, then --preset tuned-{n}r/manifest.json")


@dataclass(frozen=True)
class Fifo:
    slots: int
    slot_bytes: int


@dataclass(frozen=True)
class Entry:
    """One loaded program and the sizes (the whole buffer, nccl-tests' "size") it serves:
    ``min_bytes <= size < max_bytes`` (``max_bytes`` 0: no upper bound)."""

    program: str
    protocol: Protocol | None = None     # None: the program's own
    min_bytes: int = 0
    max_bytes: int = 0
    bytes_per_block: int = 1 << 17
    max_split: int = 1
    tile_bytes: int = 0                  # cap on a tile (pipelining at mid sizes); 0: the slot decides

    def covers(self, nbytes: int) -> bool:
        return nbytes >= self.min_bytes and (self.max_bytes == 0 or nbytes < self.max_bytes)

    def path(self) -> Path:
        p = Path(self.program)
        return p if p.is_absolute() or p.exists() else PROGRAM_DIR / p

    @property
    def is_library(self) -> bool:
        """Whether the program names a GC3 library algorithm (compiled for the communicator)."""
        return not self.program.endswith(".xml") and self.program in ALGORITHMS

    def load(self, nranks: int) -> Program:
        """The entry's program: its library algorithm compiled for ``nranks`` ranks, or its XML file."""
        return compile_algorithm(self.program, nranks) if self.is_library else read_xml(self.path())


@dataclass(frozen=True)
class Preset:
    name: str
    threads: int
    max_channels: int
    max_split: int
    fifo: dict[Protocol, Fifo]
    entries: tuple[Entry, ...]
    device: str = ""                      # the GPU the table was tuned on ("" : not recorded)

    def to_json(self) -> dict:
        return {
            **header(KIND, VERSION), **({"device": self.device} if self.device else {}), "threads": self.threads, "max_channels": self.max_channels,
            "max_split": self.max_split,
            "fifo": {p.value: {"slots": f.slots, "slot_bytes": f.slot_bytes} for p, f in self.fifo.items()},
            "programs": [{"program": e.program, "protocol": e.protocol.value if e.protocol else None,
                          "min_bytes": e.min_bytes, "max_bytes": e.max_bytes,
                          "bytes_per_block": e.bytes_per_block, "max_split": e.max_split,
                          "tile_bytes": e.tile_bytes} for e in self.entries],
        }

    @classmethod
    def from_json(cls, data: dict, name: str = "") -> "Preset":
        check_header(data, KIND, VERSION, "interpreter preset", "update the preset file", repr(name),
                     (None,))
        try:
            fifo = {Protocol(k): Fifo(int(v["slots"]), int(v["slot_bytes"])) for k, v in data["fifo"].items()}
            entries = tuple(Entry(program=e["program"],
                                  protocol=Protocol(e["protocol"]) if e.get("protocol") else None,
                                  min_bytes=int(e.get("min_bytes", 0)), max_bytes=int(e.get("max_bytes", 0)),
                                  bytes_per_block=int(e.get("bytes_per_block", 1 << 17)),
                                  max_split=int(e.get("max_split", 1)),
                                  tile_bytes=int(e.get("tile_bytes", 0)))
                            for e in data.get("programs", []))
            device = str(data.get("device") or (data.get("provenance") or {}).get("device") or "")
            preset = cls(name=name, threads=int(data["threads"]), max_channels=int(data["max_channels"]),
                         max_split=int(data["max_split"]), fifo=fifo, entries=entries, device=device)
        except (KeyError, ValueError, TypeError) as e:
            raise UserError(f"preset {name!r} is malformed ({e}); compare it with presets/{DEFAULT_PRESET}.json") \
                from None
        preset.validate()
        return preset

    def validate(self) -> None:
        if not 32 <= self.threads <= 512 or self.threads % 32:
            raise UserError(f"preset {self.name!r}: threads={self.threads}; use a multiple of 32 up to 512")
        for p in (Protocol.SIMPLE, Protocol.LL, Protocol.LL128):
            f = self.fifo.get(p)
            if f is None and p == Protocol.LL128:
                continue   # optional: only presets that use LL128 carry its FIFO
            if f is None or f.slots < 1 or f.slot_bytes < 256 or f.slot_bytes % 256:
                raise UserError(f"preset {self.name!r}: fifo {p.value} needs slots >= 1 and slot_bytes a "
                                f"multiple of 256")
        for e in self.entries:
            if e.protocol is not None and e.protocol not in self.fifo:
                raise UserError(f"preset {self.name!r}: {e.program} uses {e.protocol.value} but the preset has no "
                                f"{e.protocol.value} FIFO; add one under \"fifo\"")
            if e.max_split > self.max_split or e.max_split < 1:
                raise UserError(f"preset {self.name!r}: {e.program} max_split={e.max_split} outside "
                                f"1..{self.max_split}")


def programs_for(preset: Preset, nranks: int, device: str = "",
                 entries: tuple[Entry, ...] | None = None) -> list[tuple[Entry, Program]]:
    """Each entry's program for a communicator of ``nranks`` ranks on GPU ``device`` (library ones
    compiled once each), before any work: a table tuned on another GPU, or a program for another
    rank count, is one ``UserError`` naming the command that makes the right table."""
    make = TUNE_COMMAND.format(n=nranks)
    if preset.device and device and device != preset.device:
        raise UserError(f"preset {preset.name!r} is a table tuned on {preset.device}, this GPU is {device}: "
                        f"make one on this machine with {make}")
    cache: dict[str, Program] = {}
    out = []
    for e in preset.entries if entries is None else entries:
        if e.program not in cache:
            cache[e.program] = e.load(nranks)
        program = cache[e.program]
        if program.ngpus != nranks:
            raise UserError(f"preset {preset.name!r}: program {program.name!r} is for {program.ngpus} ranks, the "
                            f"communicator has {nranks}; make a table for {nranks} ranks with {make}")
        out.append((e, program))
    return out


def fifo_for(preset: Preset, protocol: Protocol) -> Fifo:
    """The preset's FIFO of ``protocol``, or a UserError saying how to add one."""
    f = preset.fifo.get(protocol)
    if f is None:
        raise UserError(f"preset {preset.name!r} has no {protocol.value} FIFO; add one under \"fifo\" "
                        f"(e.g. \"{protocol.value}\": {{\"slots\": 8, \"slot_bytes\": 65536}})")
    return f


def load_preset(name_or_path: str = DEFAULT_PRESET) -> Preset:
    """A shipped preset by name, or a preset file; a file's relative program paths that name a file
    beside it (its own directory) are resolved there, so a written manifest loads from any cwd."""
    data, name = read_named_json(name_or_path, PRESET_DIR, "interpreter preset")
    preset = Preset.from_json(data, name=name)
    path = Path(name_or_path)
    if not path.is_file():
        return preset
    here = path.resolve().parent
    entries = tuple(dataclasses.replace(e, program=str(here / e.program))
                    if not Path(e.program).is_absolute() and (here / e.program).is_file() else e
                    for e in preset.entries)
    return dataclasses.replace(preset, entries=entries)
