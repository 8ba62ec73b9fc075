"""The shipped table from a GPU run: per collective and measured size, the fastest of
the shipped table (``interp``) and the candidate tables (``interp[PRESET]``) among
the rows the run checked correct; a candidate replaces the shipped entry only where
it is faster by more than ``margin``. So the selection takes a new path (two-shot,
LL128) only where a GPU run measured it correct and faster.

    python -m kernels peers --retune merged.json --preset h200x2 --out kernels/interp/presets/h200x2.json

Sizes between two measured ones: the band changes at their geometric middle.
Collectives the record does not cover keep the base table's entries.
"""
from __future__ import annotations

import dataclasses
import math

from calibrate.errors import OptionError

from kernels.interp.peer_table import is_ours
from kernels.interp.preset import Entry, Preset, load_preset


def covering(preset: Preset, collective: str, nbytes: int, programs: dict[str, str]) -> Entry | None:
    """The first entry of ``preset`` for ``collective`` that covers ``nbytes`` (``programs``: file ->
    collective, for the entries' programs)."""
    for e in preset.entries:
        if programs.get(e.program) == collective and e.covers(nbytes):
            return e
    return None


def winners(rows: list[dict], margin: float) -> dict[tuple[str, int], str]:
    """(collective, size) -> the fastest correct table: ``interp`` unless a candidate beats it by ``margin``."""
    best: dict[tuple[str, int], dict] = {}
    ours: dict[tuple[str, int], dict] = {}
    for r in rows:
        if not is_ours(r["peer"]) or not r.get("correct") or not math.isfinite(r.get("us", math.nan)):
            continue
        key = (r["collective"], r["bytes"])
        if r["peer"] == "interp":
            ours[key] = r
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    out = {}
    for key, r in best.items():
        base = ours.get(key)
        out[key] = r["peer"] if base is None or r["us"] < base["us"] * (1 - margin) else "interp"
    return out


def retune(rows: list[dict], base: Preset, candidates: dict[str, Preset], programs: dict[str, str],
           margin: float = 0.03) -> Preset:
    """``base`` with the bands of every measured collective rebuilt from ``winners`` (a size the
    winning table leaves to NCCL stays with NCCL)."""
    win = winners(rows, margin)
    tables = {"interp": base, **{f"interp[{name}]": p for name, p in candidates.items()}}
    missing = sorted({w for w in win.values() if w not in tables})
    if missing:
        raise OptionError("candidates", f"lacks the record's winners {', '.join(missing)}, which are not among "
                                        f"the candidate presets given: pass them too")
    entries: list[Entry] = []
    fifo = dict(base.fifo)
    done = set()
    order = list(dict.fromkeys(programs.get(e.program) for e in base.entries))   # the base table's order
    for coll in sorted({c for c, _ in win}, key=lambda c: (order.index(c) if c in order else len(order), c)):
        sizes = sorted(s for c, s in win if c == coll)
        bands: list[tuple[int, Entry | None]] = []
        for i, s in enumerate(sizes):
            table = tables[win[(coll, s)]]
            e = covering(table, coll, s, programs)
            lo = 0 if i == 0 else int(math.sqrt(sizes[i - 1] * s))
            if bands and bands[-1][1] == e:
                continue
            bands.append((lo, e))
            if e is not None and e.protocol is not None and e.protocol not in fifo:
                fifo[e.protocol] = table.fifo[e.protocol]
        for i, (lo, e) in enumerate(bands):
            hi = bands[i + 1][0] if i + 1 < len(bands) else 0
            if e is not None:
                entries.append(dataclasses.replace(e, min_bytes=lo, max_bytes=hi))
        done.add(coll)
    entries += [e for e in base.entries if programs.get(e.program) not in done]   # e.g. alltoall, unmeasured
    return dataclasses.replace(base, entries=tuple(entries), fifo=fifo)


def load_tables(base_name: str, candidate_names: list[str],
                nranks: int = 2) -> tuple[Preset, dict[str, Preset], dict[str, str]]:
    base = load_preset(base_name)
    cands = {c: load_preset(c) for c in candidate_names}
    programs = {}
    for p in (base, *cands.values()):
        for e in p.entries:
            if e.program not in programs:
                programs[e.program] = e.load(nranks).collective
    return base, cands, programs

