"""Host side of the interpreter: validate an IR for one rank and pack it into the
program image the CUDA interpreter reads; size chunks, slices, tiles and scratch;
lay out the launch parameters.

No GPU needed: everything here is plain numpy and is unit tested in CI.

Packed (a rank's program, decoded):
  tbs   [ntb, 2]   step_start, nsteps
  steps [nsteps, 9] type, srcbuf, srcoff, dstbuf, dstoff, cnt, ndeps, dep_start, has_dep
  deps  [ndeps, 2] thread block, step
Image (u64 words, kernels/interp/interp.cu says how the kernel reads them): per
thread block its connection ends and step count, its steps padded to the largest
step count, the dependencies. It travels in the kernel parameters (PARAMS) when it
has at most IMG_WORDS words, in global memory otherwise.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np

from calibrate.errors import UserError
from kernels.gc3.ir import Buffer, Program, Protocol, StepType

OPCODES = {
    StepType.SEND: 0, StepType.RECV: 1, StepType.RECV_COPY_SEND: 2, StepType.RECV_REDUCE_SEND: 3,
    StepType.RECV_REDUCE_COPY: 4, StepType.RECV_REDUCE_COPY_SEND: 5, StepType.COPY: 6,
    StepType.REDUCE: 7, StepType.NOP: 8,
}
BUFFERS = {Buffer.INPUT: 0, Buffer.OUTPUT: 1, Buffer.SCRATCH: 2}
PROTOCOLS = {Protocol.SIMPLE: 0, Protocol.LL: 1, Protocol.LL128: 2}
# protocols the schedule autotuner proposes: those its cost model was fitted for (Simple, LL; the
# interpreter sweep of 2026-11-22). LL128 was checked equal to NCCL on GPUs on 2026-11-23 (every
# program, float32 and bfloat16) and serves the shipped table, but is not in the model's sweep yet.
VALIDATED_PROTOCOLS = (Protocol.SIMPLE, Protocol.LL)
LL128_LINE, LL128_DATA = 128, 120   # bytes of an LL128 line, of its data
LL128_TILE_STEP = 240               # LL128 tiles are whole lines and 16-byte multiples: lcm(120, 16)
STEP_FIELDS = 9
IMG_WORDS = 256     # image words carried in the kernel parameters (interp.cu IMG_WORDS)
TB_WORDS = 7        # send fifo, send line, peer's receive line, receive fifo, receive line, peer's send line, nsteps
STEP_WORDS = 3

# struct Params of interp.cu, byte for byte
PARAMS = np.dtype([("buf", "<u8", (3,)), ("chunk", "<i8"), ("slice", "<i8"), ("tile", "<i8"), ("slot_bytes", "<i8"),
                   ("sems", "<u8"), ("epochs", "<u8"), ("gimg", "<u8"), ("split", "<i4"), ("proto", "<i4"),
                   ("slot_mask", "<i4"), ("stride", "<i4"), ("steps_at", "<i4"), ("deps_at", "<i4"),
                   ("img", "<u8", (IMG_WORDS,))])

DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # name -> bytes per element
REDUCTIONS = ("sum",)

# collectives whose "buffer" (the size nchunksperloop divides) is ranks x the per-rank count
_SCALED = ("allgather", "reducescatter")


@dataclass(frozen=True)
class Packed:
    """One rank's share of a program, as the kernel reads it."""

    rank: int
    tbs: np.ndarray
    steps: np.ndarray
    deps: np.ndarray
    send_peer: tuple[int, ...]   # per IR thread block, -1 when none
    recv_peer: tuple[int, ...]
    chan: tuple[int, ...]
    max_cnt: int
    chunks: dict[str, int]       # i/o/s chunk counts

    @property
    def ntb(self) -> int:
        return len(self.send_peer)


def check_connections(program: Program) -> None:
    """Every (sender, receiver, channel) connection is used by one thread block at each
    end, and the sender's counts match the receiver's, in order: otherwise the
    interpreter would deadlock or misread a slot."""
    sends: dict[tuple[int, int, int], list[int]] = {}
    recvs: dict[tuple[int, int, int], list[int]] = {}
    for gpu in program.gpus:
        seen_s: set[tuple[int, int]] = set()
        seen_r: set[tuple[int, int]] = set()
        for tb in gpu.threadblocks:
            for peer, seen, table, key, role in (
                    (tb.send, seen_s, sends, (gpu.id, tb.send, tb.chan), "send"),
                    (tb.recv, seen_r, recvs, (tb.recv, gpu.id, tb.chan), "recv")):
                if peer < 0:
                    continue
                if (peer, tb.chan) in seen:
                    raise UserError(f"program {program.name!r} gpu {gpu.id}: two thread blocks {role} with "
                                    f"peer {peer} on channel {tb.chan}; give each its own channel")
                seen.add((peer, tb.chan))
                kind = StepType.sends if role == "send" else StepType.receives
                table[key] = [st.cnt for st in tb.steps if kind.fget(st.type)]
    for key in sorted(set(sends) | set(recvs)):
        s, r = sends.get(key, []), recvs.get(key, [])
        if s != r:
            raise UserError(f"program {program.name!r}: gpu {key[0]} sends {s} chunks to gpu {key[1]} on channel "
                            f"{key[2]} but gpu {key[1]} receives {r}; the program is inconsistent, recompile it")


def pack(program: Program, rank: int, nranks: int) -> Packed:
    """Validate ``program`` for a communicator of ``nranks`` and pack rank ``rank``'s part."""
    if program.ngpus != nranks:
        raise UserError(f"program {program.name!r} is for {program.ngpus} ranks but the communicator has "
                        f"{nranks}; load a program compiled for {nranks} ranks")
    if not 0 <= rank < nranks:
        raise UserError(f"rank {rank} outside 0..{nranks - 1}")
    check_connections(program)
    gpu = program.gpus[rank]
    tbs, steps, deps = [], [], []
    for tb in gpu.threadblocks:
        tbs.append((len(steps), len(tb.steps)))
        for st in tb.steps:
            dep_start = len(deps)
            deps.extend(st.deps)
            src = BUFFERS[st.srcbuf] if st.srcoff >= 0 else 0
            dst = BUFFERS[st.dstbuf] if st.dstoff >= 0 else 0
            steps.append((OPCODES[st.type], src, max(st.srcoff, 0), dst, max(st.dstoff, 0), st.cnt,
                          len(st.deps), dep_start, int(st.has_dep)))
    return Packed(
        rank=rank,
        tbs=np.asarray(tbs, dtype=np.int32).reshape(-1, 2),
        steps=np.asarray(steps, dtype=np.int32).reshape(-1, STEP_FIELDS),
        deps=np.asarray(deps if deps else [(0, 0)], dtype=np.int32).reshape(-1, 2),
        send_peer=tuple(tb.send for tb in gpu.threadblocks),
        recv_peer=tuple(tb.recv for tb in gpu.threadblocks),
        chan=tuple(tb.chan for tb in gpu.threadblocks),
        max_cnt=max((st.cnt for tb in gpu.threadblocks for st in tb.steps), default=1) or 1,
        chunks={"i": gpu.i_chunks, "o": gpu.o_chunks, "s": gpu.s_chunks},
    )


def buffer_elems(collective: str, count: int, nranks: int) -> tuple[int, int]:
    """(input elements, output elements) of one rank for an NCCL-style ``count``
    (allreduce/alltoall: the buffer; allgather: the send count; reducescatter: the receive count)."""
    if collective == "allgather":
        return count, count * nranks
    if collective == "reducescatter":
        return count * nranks, count
    return count, count


def chunk_elems(program: Program, count: int, nranks: int) -> int:
    """Elements per chunk: the buffer divided by nchunksperloop, the buffer being ranks x count
    for allgather and reducescatter (../shared/interop/msccl/README.md)."""
    if count <= 0:
        raise UserError(f"count={count}: give a positive element count")
    whole = count * nranks if program.collective in _SCALED else count
    if whole % program.nchunksperloop:
        step = program.nchunksperloop // np.gcd(program.nchunksperloop, nranks if program.collective in _SCALED
                                                else 1)
        raise UserError(f"count={count} does not split into the {program.nchunksperloop} chunks of program "
                        f"{program.name!r}; use a multiple of {step} elements or another program")
    return whole // program.nchunksperloop


def min_count(program: Program, nranks: int) -> int:
    """The smallest legal count for ``program``."""
    if program.collective in _SCALED:
        return program.nchunksperloop // int(np.gcd(program.nchunksperloop, nranks))
    return program.nchunksperloop


def check_buffers(packed: Packed, chunk: int, in_elems: int, out_elems: int, name: str) -> None:
    """The buffers handed in hold every chunk the program addresses."""
    for key, have, label in (("i", in_elems, "input"), ("o", out_elems, "output")):
        need = packed.chunks[key] * chunk
        if need > have:
            raise UserError(f"program {name!r} needs {need} elements of {label} buffer, got {have}; "
                            f"pass a larger {label} buffer")


def scratch_elems(packed: Packed, chunk: int) -> int:
    return packed.chunks["s"] * chunk


def tile_elems(protocol: Protocol, slot_bytes: int, elem_bytes: int, max_cnt: int, cap_bytes: int = 0) -> int:
    """Elements of one chunk that one step moves per tile: a slot holds ``max_cnt`` pieces;
    LL carries 8 data bytes per 16-byte line, LL128 120 per 128-byte line; ``cap_bytes`` (if > 0)
    bounds it. A multiple of 16 bytes (LL128: of 240, whole lines)."""
    step = LL128_TILE_STEP if protocol == Protocol.LL128 else 16
    if protocol == Protocol.LL:
        data = slot_bytes // 2
    elif protocol == Protocol.LL128:
        data = slot_bytes // LL128_LINE * LL128_DATA
    else:
        data = slot_bytes
    per = (data // max_cnt) // step * step
    if cap_bytes:
        per = min(per, max(step, cap_bytes // step * step))
    if per < 16:
        raise UserError(f"slot of {slot_bytes} bytes cannot hold {max_cnt} pieces; raise slot_bytes in the preset")
    return per // elem_bytes


@dataclass(frozen=True)
class Geometry:
    """How a launch is laid out: ``split`` CUDA blocks per IR thread block, ``tile_elems``
    elements of each chunk piece per tile, ``blocks`` CUDA blocks in the grid."""

    split: int
    tile_elems: int
    blocks: int
    esize: int

    def piece_tiles(self, chunk_bytes: float) -> int:
        """Tiles of one CUDA block's piece of a chunk of ``chunk_bytes``."""
        return max(1, math.ceil(chunk_bytes / self.split / (self.tile_elems * self.esize)))


def launch_geometry(protocol: Protocol, esize: int, slot_bytes: int, max_cnt: int, ntb: int, split: int,
                    tile_cap: int = 0) -> Geometry:
    """The layout of a launch of ``ntb`` thread blocks whose steps move at most ``max_cnt``
    chunks, with ``split`` and the entry's tile cap: what the runtime launches and the cost
    model (``kernels.interp.model``) charges."""
    return Geometry(split, tile_elems(protocol, slot_bytes, esize, max(1, max_cnt), tile_cap), ntb * split, esize)


def split_for(chunk_bytes: int, bytes_per_block: int, max_split: int) -> int:
    """CUDA blocks per IR thread block: one per ``bytes_per_block`` of a chunk, 1..max_split."""
    return int(min(max(1, -(-chunk_bytes // max(1, bytes_per_block))), max_split))


def check_request(program: Program, dtype: str, op: str, protocol: Protocol) -> None:
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not supported by the interpreter; use one of {', '.join(DTYPES)}")
    if op not in REDUCTIONS:
        raise UserError(f"reduction {op!r} is not supported by the interpreter; use one of {', '.join(REDUCTIONS)}")
    if protocol not in PROTOCOLS:
        raise UserError(f"program {program.name!r} asks for protocol {protocol.value}, which the interpreter "
                        f"does not implement; override it with protocol Simple, LL or LL128")


@dataclass(frozen=True)
class Image:
    """A rank's program with its connection ends, as the kernel reads it."""

    words: np.ndarray   # uint64
    stride: int         # step entries per thread block
    steps_at: int
    deps_at: int

    @property
    def in_params(self) -> bool:
        return len(self.words) <= IMG_WORDS


def image(packed: Packed, ends: list[tuple[int, int, int, int, int, int]]) -> Image:
    """The image of ``packed``; ``ends[tb]``: the thread block's slice-0 addresses (send FIFO,
    send line, peer's receive line, receive FIFO, receive line, peer's send line; 0 where none)."""
    if len(ends) != packed.ntb:
        raise UserError(f"{len(ends)} connection ends for {packed.ntb} thread blocks; pass one tuple per block")
    nsteps = packed.tbs[:, 1] if packed.ntb else np.zeros(0, dtype=np.int32)
    stride = max(1, int(nsteps.max(initial=0)))
    steps_at = packed.ntb * TB_WORDS
    deps_at = steps_at + packed.ntb * stride * STEP_WORDS
    ndeps = int(packed.steps[:, 6].sum()) if len(packed.steps) else 0
    words = np.zeros(deps_at + ndeps, dtype=np.uint64)
    for tb in range(packed.ntb):
        words[tb * TB_WORDS:(tb + 1) * TB_WORDS] = [*ends[tb], int(nsteps[tb])]
        start = int(packed.tbs[tb, 0])
        for s in range(int(nsteps[tb])):
            op, src, srcoff, dst, dstoff, cnt, nd, dep_start, has_dep = (int(x) for x in packed.steps[start + s])
            at = steps_at + (tb * stride + s) * STEP_WORDS
            words[at:at + STEP_WORDS] = [op | src << 8 | dst << 16 | has_dep << 24 | cnt << 32,
                                         srcoff | dstoff << 32, nd | dep_start << 32]
    for d in range(ndeps):
        dtb, dstep = (int(x) for x in packed.deps[d])
        words[deps_at + d] = dtb | dstep << 32
    return Image(words, stride, steps_at, deps_at)


def slice_elems(chunk: int, split: int, elem_bytes: int) -> int:
    """Elements of a chunk that each of ``split`` CUDA blocks handles, a multiple of 16 bytes."""
    v = 16 // elem_bytes
    per = -(-chunk // split)
    return -(-per // v) * v


def params(img: Image, gimg: int, bufs: tuple[int, int, int], chunk: int, split: int, elem_bytes: int, tile: int,
           protocol: Protocol, slots: int, slot_bytes: int, sems: int, epochs: int) -> np.ndarray:
    """The kernel's one argument (struct Params, passed by value); ``gimg``: the image's device
    address when it is not ``in_params`` (else ignored)."""
    p = np.zeros(1, dtype=PARAMS)
    p["buf"] = bufs
    p["chunk"], p["slice"], p["tile"], p["slot_bytes"] = chunk, slice_elems(chunk, split, elem_bytes), tile, slot_bytes
    p["sems"], p["epochs"] = sems, epochs
    p["split"], p["proto"], p["slot_mask"] = split, PROTOCOLS[protocol], slots - 1
    p["stride"], p["steps_at"], p["deps_at"] = img.stride, img.steps_at, img.deps_at
    if img.in_params:
        p["img"][0, :len(img.words)] = img.words
    else:
        p["gimg"] = gimg
    return p
