"""What an IR's buffers mean for each collective: sizes, in-place aliasing, expected result.

R ranks, C = nchunksperloop. A chunk is the user's buffer divided by C, the
buffer being the output for allgather and the input otherwise, so that:

    collective      input chunks  output chunks  expected output of rank r
    allreduce       C             C              sum over ranks of the inputs
    reducescatter   C             C/R            chunks [r*C/R, (r+1)*C/R) of that sum
    allgather       C/R           C              inputs of ranks 0..R-1, one after another
    alltoall        C             C              chunk block r of every rank's input, by rank
    custom          C             o_chunks       the custom collective's postcondition

In-place programs (``inplace=1``), as msccl-tools writes them (worked out from the
reference XML files, where in-place allreduce and reducescatter have o_chunks=0
and in-place allgather has i_chunks=0):
- allreduce: the output buffer is the input buffer (o -> i);
- allgather: the input of rank r lives in the output, i[k] -> o[r*C/R + k];
- reducescatter: the output of rank r lives in the input, o[k] -> i[r*C/R + k];
- custom (e.g. alltonext): msccl-tools renames no buffer, so i, o and s stay
  distinct buffers and the result is read from o.
An out-of-place program keeps i, o and s distinct.

Custom collectives are looked up in ``CUSTOM`` by the prefix of the program
name (``alltonext-forward`` -> ``alltonext``).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from calibrate.errors import UserError
from kernels.gc3.ir import Buffer, Program

COLLECTIVES = ("allreduce", "reducescatter", "allgather", "alltoall", "custom")


def _alltonext(inputs: list[np.ndarray]) -> list[np.ndarray | None]:
    """Rank r > 0 ends with rank r-1's input in its output; rank 0 has no output."""
    return [None] + [inputs[r - 1].copy() for r in range(1, len(inputs))]


# custom collective name -> expected outputs per rank (None: the rank has no output)
CUSTOM: dict[str, Callable[[list[np.ndarray]], list[np.ndarray | None]]] = {
    "alltonext": _alltonext,
}


def custom_name(program: Program) -> str:
    for name in CUSTOM:
        if program.name.lower().replace("_", "").startswith(name):
            return name
    raise UserError(f"custom collective {program.name!r} has no known postcondition; name the program after "
                    f"one of {', '.join(CUSTOM)} or add its postcondition to kernels.gc3.semantics.CUSTOM")


def _check_collective(coll: str) -> None:
    if coll not in COLLECTIVES:
        raise UserError(f"unknown collective {coll!r}; expected one of {', '.join(COLLECTIVES)}")


def input_chunks(program: Program) -> int:
    """Chunks in each rank's user input buffer."""
    _check_collective(program.collective)
    c, r = program.nchunksperloop, program.ngpus
    if program.collective == "allgather":
        if c % r:
            raise UserError(f"allgather with nchunksperloop={c} not a multiple of ngpus={r}")
        return c // r
    return c


def output_chunks(program: Program, rank: int) -> int:
    """Chunks in rank ``rank``'s user output buffer."""
    _check_collective(program.collective)
    c, r = program.nchunksperloop, program.ngpus
    if program.collective == "reducescatter":
        if c % r:
            raise UserError(f"reducescatter with nchunksperloop={c} not a multiple of ngpus={r}")
        return c // r
    if program.collective == "custom":
        return program.gpus[rank].o_chunks
    return c


def alias_index(collective: str, inplace: bool, ngpus: int, nchunks: int, rank: int, buf: Buffer,
                off: int) -> tuple[Buffer, int]:
    """The storage (buffer, chunk offset) of chunk ``buf[off]`` of ``rank`` (C = ``nchunks``)."""
    if not inplace:
        return buf, off
    if collective == "allreduce" and buf == Buffer.OUTPUT:
        return Buffer.INPUT, off
    if collective == "allgather" and buf == Buffer.INPUT:
        return Buffer.OUTPUT, rank * (nchunks // ngpus) + off
    if collective == "reducescatter" and buf == Buffer.OUTPUT:
        return Buffer.INPUT, rank * (nchunks // ngpus) + off
    return buf, off


def logical_index(collective: str, inplace: bool, ngpus: int, nchunks: int, rank: int, buf: Buffer, off: int,
                  logical: Buffer) -> int | None:
    """The inverse of ``alias_index``: the chunk k of user buffer ``logical`` of ``rank`` stored at
    ``buf[off]``, or None if none is (k is not checked against the buffer's size)."""
    if inplace:
        per = nchunks // ngpus
        if collective == "allgather" and logical == Buffer.INPUT:
            return off - rank * per if buf == Buffer.OUTPUT and rank * per <= off < (rank + 1) * per else None
        if collective == "reducescatter" and logical == Buffer.OUTPUT:
            return off - rank * per if buf == Buffer.INPUT and rank * per <= off < (rank + 1) * per else None
        if collective == "allreduce" and logical == Buffer.OUTPUT:
            return off if buf == Buffer.INPUT else None
    return off if buf == logical else None


def alias(program: Program, rank: int, buf: Buffer, off: int) -> tuple[Buffer, int]:
    """The storage (buffer, chunk offset) that chunk ``buf[off]`` of ``rank`` really is."""
    return alias_index(program.collective, program.inplace, program.ngpus, program.nchunksperloop, rank, buf, off)


def storage_chunks(program: Program, rank: int) -> dict[Buffer, int]:
    """How many chunks each storage buffer of ``rank`` holds (aliased ones have 0)."""
    gpu = program.gpus[rank]
    sizes = {Buffer.INPUT: max(gpu.i_chunks, input_chunks(program)),
             Buffer.OUTPUT: max(gpu.o_chunks, output_chunks(program, rank)),
             Buffer.SCRATCH: gpu.s_chunks}
    if program.inplace and program.collective in ("allreduce", "reducescatter"):
        sizes[Buffer.OUTPUT] = 0
    if program.inplace and program.collective == "allgather":
        sizes[Buffer.INPUT] = 0
    return sizes


def reference_result(collective: str, inputs: list[np.ndarray], custom: str = "") -> list[np.ndarray | None]:
    """The collective's expected output per rank (flat arrays) from the flat inputs per rank."""
    _check_collective(collective)
    r = len(inputs)
    if collective == "allreduce":
        total = np.sum(np.stack(inputs), axis=0, dtype=np.float64).astype(inputs[0].dtype)
        return [total.copy() for _ in range(r)]
    if collective == "reducescatter":
        total = np.sum(np.stack(inputs), axis=0, dtype=np.float64).astype(inputs[0].dtype)
        return [part.copy() for part in np.split(total, r)]
    if collective == "allgather":
        whole = np.concatenate(inputs)
        return [whole.copy() for _ in range(r)]
    if collective == "alltoall":
        blocks = [np.split(x, r) for x in inputs]
        return [np.concatenate([blocks[src][dst] for src in range(r)]) for dst in range(r)]
    if custom not in CUSTOM:
        raise UserError(f"custom collective needs a known postcondition name, one of {', '.join(CUSTOM)}")
    return CUSTOM[custom](inputs)
