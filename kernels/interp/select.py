"""Which loaded program serves a call, and why (the runtime's ``--explain``).

GC3 §6: the runtime picks a program by user-configured size ranges and falls
back to NCCL outside them. Pure host code, unit tested in CI.
"""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.errors import UserError
from kernels.gc3.ir import Program, Protocol

from kernels.interp import pack
from kernels.interp.preset import Entry


@dataclass(frozen=True)
class Choice:
    entry: Entry | None          # None: NCCL
    program: Program | None
    protocol: Protocol | None
    chunk: int = 0               # elements per chunk
    split: int = 0               # CUDA blocks per IR thread block
    reason: str = ""

    @property
    def uses_nccl(self) -> bool:
        return self.entry is None


def choose(loaded: list[tuple[Entry, Program]], collective: str, count: int, dtype: str, nranks: int,
           max_split: int, op: str = "sum") -> Choice:
    """The first loaded program that fits the call, else NCCL; ``reason`` says why."""
    if dtype not in pack.DTYPES:
        raise UserError(f"dtype {dtype!r} is not supported; use one of {', '.join(pack.DTYPES)}")
    in_elems, out_elems = pack.buffer_elems(collective, count, nranks)
    nbytes = max(in_elems, out_elems) * pack.DTYPES[dtype]
    why: list[str] = []
    for entry, program in loaded:
        label = f"{program.name} ({entry.protocol.value if entry.protocol else program.protocol.value})"
        if program.collective != collective:
            continue
        if not entry.covers(nbytes):
            hi = entry.max_bytes or "inf"
            why.append(f"{label}: {nbytes} B outside [{entry.min_bytes}, {hi})")
            continue
        if program.ngpus != nranks:
            why.append(f"{label}: for {program.ngpus} ranks, communicator has {nranks}")
            continue
        if op not in pack.REDUCTIONS:
            why.append(f"{label}: reduction {op!r} unsupported")
            continue
        whole = max(in_elems, out_elems) if collective in ("allgather", "reducescatter") else count
        if whole % program.nchunksperloop:
            why.append(f"{label}: {whole} elements do not split into {program.nchunksperloop} chunks")
            continue
        protocol = entry.protocol or program.protocol
        if protocol not in pack.PROTOCOLS:
            why.append(f"{label}: protocol {protocol.value} not implemented")
            continue
        chunk = pack.chunk_elems(program, count, nranks)
        split = pack.split_for(chunk * pack.DTYPES[dtype], entry.bytes_per_block, min(entry.max_split, max_split))
        reason = (f"{collective} of {nbytes} B ({dtype}): program {program.name} with {protocol.value}, "
                  f"{len(program.gpus[0].threadblocks)} thread blocks x split {split}, chunk {chunk} elements; "
                  f"range [{entry.min_bytes}, {entry.max_bytes or 'inf'})")
        if why:
            reason += "; skipped " + "; ".join(why)
        return Choice(entry, program, protocol, chunk, split, reason)
    if not why:
        why.append(f"no {collective} program loaded")
    return Choice(None, None, None, reason=f"{collective} of {nbytes} B ({dtype}): NCCL, because " + "; ".join(why))
