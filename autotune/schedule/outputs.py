"""What the tuner writes: one MSCCL XML file per table entry (minBytes/maxBytes set),
a manifest in the interpreter's preset format (kernels.interp.preset) that its
selection loads, and the NCCL tuner table.

NCCL tuner table: ``kernels.nccl_tuner.table``, the one format that commtune's
tuner plugin and NCCL's ext-tuner/example plugin read, written and read by that
module only (``python -m autotune nccl`` writes it too). Its max_bytes is
inclusive, so a half-open band [lo, hi) is written as lo..hi-1, and an
unbounded band as 2^64-1. Sizes are taken to be
NCCL's nBytes for the collective, the whole buffer as nccl-tests counts it
(our convention throughout). NCCL has only its own algorithms (ring, tree, ...):
a band is exported only when its chosen program has an NCCL counterpart in the
search space's ``nccl_algorithm`` map; other bands get a comment line and NCCL
keeps its own choice there.
"""
from __future__ import annotations
from calibrate.outputs import write_atomic
from calibrate.jsonfile import write_json

import dataclasses
import datetime as _dt
import re
from pathlib import Path

from kernels.gc3.ir import Protocol
from kernels.gc3.xml_io import write_xml
from kernels.interp.preset import Entry, Preset
from kernels.nccl_tuner.table import COLLECTIVES, SIZE_MAX, Row, write_table

from autotune.schedule.result import CollectiveResult
from autotune.schedule.space import Built, Candidate


def slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_")


def entry_for(c: Candidate, program_path: str, lo: int = 0, hi: int = 0) -> Entry:
    return Entry(program=program_path, protocol=Protocol(c.protocol), min_bytes=lo, max_bytes=hi,
                 bytes_per_block=c.bytes_per_block, max_split=c.max_split, tile_bytes=c.tile_bytes)


def transport_preset(base: Preset, built: list[Built], entries: tuple[Entry, ...], name: str) -> Preset:
    """``base``'s transport, widened to the channels and splits of ``built``, serving ``entries``."""
    chans = max((tb.chan for b in built for g in b.program.gpus for tb in g.threadblocks), default=0) + 1
    split = max((b.candidate.max_split for b in built), default=1)
    preset = Preset(name=name, threads=base.threads, max_channels=max(base.max_channels, chans),
                    max_split=max(base.max_split, split), fifo=base.fifo, entries=entries)
    preset.validate()
    return preset


def write_programs(out: Path, res: CollectiveResult, built: dict[str, Built]) -> list[Path]:
    """One XML per table entry, named after it; sets ``TableEntry.xml`` to its path relative to ``out``
(where the manifest goes: kernels.interp.preset resolves it against the manifest's directory)."""
    paths = []
    for i, t in enumerate(res.table):
        b = built[t.choice]
        program = dataclasses.replace(b.program, name=f"{res.collective}_{slug(t.choice)}",
                                      protocol=Protocol(b.candidate.protocol), min_bytes=t.lo, max_bytes=t.hi)
        path = out / "programs" / f"{res.collective}_{i:02d}_{slug(t.choice)}.xml"
        write_atomic(path, write_xml(program), "program")
        t.xml = str(path.relative_to(out))
        paths.append(path)
    return paths


def manifest(results: list[CollectiveResult], built: dict[str, dict[str, Built]], base: Preset,
             name: str) -> Preset:
    """The interpreter preset serving every table entry (written after ``write_programs``)."""
    entries = []
    used = []
    for res in results:
        for t in res.table:
            b = built[res.collective][t.choice]
            entries.append(entry_for(b.candidate, t.xml, t.lo, t.hi))
            used.append(b)
    return transport_preset(base, used, tuple(entries), name)


def write_manifest(path: Path, preset: Preset, provenance: dict) -> Path:
    data = preset.to_json()
    data["description"] = ("tuned table of python -m autotune schedule: programs per size range; sizes outside "
                           "every range run on NCCL")
    data["provenance"] = provenance
    return write_json(path, data, "schedule manifest")


def nccl_csv(results: list[CollectiveResult], built: dict[str, dict[str, Built]], nccl_algorithm: dict[str, str],
             nodes: int, ranks: int) -> str:
    """The tuner table (kernels.nccl_tuner.table: NCCL's example-plugin CSV, which commtune's plugin reads)."""
    notes = [f"NCCL tuner table of python -m autotune schedule, {_dt.date.today().isoformat()}",
             "sizes: NCCL's nBytes (the whole buffer); max_bytes inclusive"]
    rows = []
    for res in results:
        for t in res.table:
            b = built[res.collective][t.choice]
            hi = SIZE_MAX if t.hi == 0 else t.hi - 1
            algo = nccl_algorithm.get(b.candidate.algorithm)
            if algo is None or res.collective not in COLLECTIVES:
                notes.append(f"{res.collective} {t.lo}..{hi}: chosen {t.choice} has no NCCL counterpart; "
                             f"NCCL keeps its own choice")
                continue
            rows.append(Row(res.collective, t.lo, hi, algo, b.candidate.protocol.lower(), b.program.nchannels,
                            nodes, ranks))
    return write_table(rows, notes)
