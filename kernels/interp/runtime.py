"""The interpreter's GPU runtime: one process per GPU, run under mpirun.

    comm = Communicator(MPI.COMM_WORLD)               # pool, IPC handles, NCCL, programs
    comm.prepare("allreduce", count, "float32")       # scratch, before any graph capture
    comm.allreduce(x, y, count, "float32", stream=s)  # a loaded program, or NCCL
    comm.explain("allreduce", count, "float32")       # which ran and why

Launches go on the given stream and are capturable in a CUDA graph: the
transport's counters and the semaphores live in device memory and only grow.
All thread blocks of a launch must be co-resident (they wait on each other):
a launch that the GPU cannot hold at once is refused before it starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from calibrate.collectives import Collective
from calibrate.device import nccl as device_nccl
from calibrate.device.gpu import device_name
from calibrate.errors import UserError
from kernels.gc3.ir import Program, Protocol

from kernels.interp import pack
from kernels.interp.layout import Layout
from kernels.interp.preset import DEFAULT_PRESET, Entry, Preset, fifo_for, load_preset, programs_for
from kernels.interp.select import Choice, choose

SOURCE = Path(__file__).with_name("interp.cu")
KERNELS = {"float32": "gc3_interp_f32", "bfloat16": "gc3_interp_bf16", "float16": "gc3_interp_f16"}
KERNEL_PROTOCOL = {Protocol.SIMPLE: "simple", Protocol.LL: "ll", Protocol.LL128: "ll128"}   # one kernel each


def kernel_name(dtype: str, protocol: Protocol) -> str:
    """The entry point of interp.cu for ``dtype`` and ``protocol`` (INTERP_ENTRY)."""
    return f"{KERNELS[dtype]}_{KERNEL_PROTOCOL[protocol]}"
NCCL_COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall")
_IPC_LAZY_PEER = 1
_D2D = 3


def _include_dirs() -> list[str]:
    """Directories holding cuda_bf16.h for NVRTC (CuPy ships cuda_fp16.h only on some builds)."""
    cands = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    try:
        import nvidia.cuda_runtime as ncr  # the pip CUDA runtime's headers, when present
        cands += [str(Path(p)) for p in ncr.__path__]
    except ImportError:
        pass
    out = []
    for c in cands:
        for inc in (Path(c) / "include", Path(c)):
            if c and (inc / "cuda_bf16.h").is_file() and str(inc) not in out:
                out.append(str(inc))
    return out


@dataclass
class _State:
    """The program image and device arrays of one (program, protocol, split) launch configuration."""

    image: pack.Image
    gimg: object        # the image in device memory when it does not fit the kernel parameters, else None
    sems: object
    epochs: object


class Communicator:
    def __init__(self, mpi_comm, preset: str | Preset = DEFAULT_PRESET, entries: list[Entry] | None = None):
        import cupy as cp

        self.cp = cp
        self.mpi = mpi_comm
        self.rank, self.nranks = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.preset = preset if isinstance(preset, Preset) else load_preset(preset)
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        # every program of the table, for this rank count and GPU, before any work
        programs = programs_for(self.preset, self.nranks, device_name(cp, dev.id),
                                None if entries is None else tuple(entries))
        self.sm_count = props["multiProcessorCount"]
        self.cc = f"{props['major']}{props['minor']}"

        self.nccl = device_nccl.communicator(mpi_comm, needs="the interpreter")

        self.layout = Layout(self.nranks, self.preset.max_channels, self.preset.max_split, self.preset.fifo)
        self.pool = cp.cuda.runtime.malloc(self.layout.nbytes)
        cp.cuda.runtime.memset(self.pool, 0, self.layout.nbytes)
        cp.cuda.runtime.deviceSynchronize()
        handles = mpi_comm.allgather(cp.cuda.runtime.ipcGetMemHandle(self.pool))
        self.bases = [self.pool if r == self.rank else cp.cuda.runtime.ipcOpenMemHandle(h, _IPC_LAZY_PEER)
                      for r, h in enumerate(handles)]
        mpi_comm.Barrier()

        opts = ("-std=c++17", f"--gpu-architecture=sm_{self.cc}") + tuple(f"-I{d}" for d in _include_dirs())
        self.module = cp.RawModule(code=SOURCE.read_text(), options=opts)
        self.kernels = {(dt, proto): self.module.get_function(kernel_name(dt, proto))
                        for dt in KERNELS for proto in KERNEL_PROTOCOL}
        # co-resident blocks per element type: the fewest of its protocols' kernels
        self.max_resident = {dt: min(self._max_resident(self.kernels[(dt, proto)]) for proto in KERNEL_PROTOCOL)
                             for dt in KERNELS}

        self.loaded: list[tuple[Entry, Program]] = []
        self._packed: dict[int, pack.Packed] = {}
        for entry, program in programs:
            self.load(entry, program)
        self._states: dict[tuple, _State] = {}
        self._scratch = None
        self._scratch_bytes = 0

    # ---- programs ----
    def load(self, entry: Entry, program: Program | None = None) -> Program:
        """Read (unless given), validate for this communicator and keep ``entry``'s program."""
        program = program if program is not None else entry.load(self.nranks)
        packed = pack.pack(program, self.rank, self.nranks)
        chans = max(packed.chan, default=0)
        if chans >= self.preset.max_channels:
            raise UserError(f"program {program.name!r} uses channel {chans}; the preset allows "
                            f"{self.preset.max_channels}: raise max_channels in the preset")
        self.loaded.append((entry, program))
        self._packed[id(program)] = packed
        return program

    def _max_resident(self, kernel) -> int:
        regs = kernel.num_regs
        warps = self.preset.threads // 32
        per_warp = -(-regs * 32 // 256) * 256
        by_regs = 65536 // (per_warp * warps) if regs else 32
        return self.sm_count * max(0, min(by_regs, 2048 // self.preset.threads, 32))

    def _state(self, program: Program, protocol: Protocol, split: int, dtype: str) -> _State:
        key = (id(program), protocol, split)
        st = self._states.get(key)
        if st is not None:
            return st
        fifo_for(self.preset, protocol)
        cp = self.cp
        packed = self._packed[id(program)]
        grid = packed.ntb * split
        if grid > self.max_resident[dtype]:
            raise UserError(f"program {program.name!r} with split {split} needs {grid} co-resident thread blocks, "
                            f"the GPU holds {self.max_resident[dtype]}; lower max_split or bytes_per_block")
        ends = []
        for tb in range(packed.ntb):
            send = recv = (0, 0, 0)
            if packed.send_peer[tb] >= 0:
                e = self.layout.send_end(protocol, self.rank, packed.send_peer[tb], packed.chan[tb], 0, self.bases)
                send = (e.fifo, e.line, e.peer_line)
            if packed.recv_peer[tb] >= 0:
                e = self.layout.recv_end(protocol, self.rank, packed.recv_peer[tb], packed.chan[tb], 0, self.bases)
                recv = (e.fifo, e.line, e.peer_line)
            ends.append(send + recv)
        image = pack.image(packed, ends)
        st = _State(image, None if image.in_params else cp.asarray(image.words),
                    cp.zeros(grid, dtype=cp.uint64), cp.zeros(grid, dtype=cp.uint64))
        self._states[key] = st
        return st

    # ---- selection ----
    def choose(self, collective: str, count: int, dtype: str, op: str = "sum") -> Choice:
        return choose(self.loaded, collective, count, dtype, self.nranks, self.preset.max_split, op)

    def explain(self, collective: str, count: int, dtype: str = "float32", op: str = "sum") -> str:
        return self.choose(collective, count, dtype, op).reason

    def choice_for(self, program: Program, protocol: Protocol, split: int, count: int, dtype: str,
                   op: str = "sum") -> Choice:
        """A launch of one loaded ``program`` with a given protocol and split, bypassing selection."""
        if id(program) not in self._packed:
            raise UserError(f"program {program.name!r} is not loaded; call load() first")
        pack.check_request(program, dtype, op, protocol)
        fifo_for(self.preset, protocol)
        if not 1 <= split <= self.preset.max_split:
            raise UserError(f"split {split} outside 1..{self.preset.max_split}; pick one in range")
        chunk = pack.chunk_elems(program, count, self.nranks)
        return Choice(Entry(program.name, protocol), program, protocol, chunk, split,
                      reason=f"{program.name} forced with {protocol.value}, split {split}")

    def prepare(self, collective: str, count: int, dtype: str = "float32", op: str = "sum") -> Choice:
        """Allocate scratch and launch state for a call, outside any graph capture."""
        c = self.choose(collective, count, dtype, op)
        if not c.uses_nccl:
            self._ensure_scratch(pack.scratch_elems(self._packed[id(c.program)], c.chunk) * pack.DTYPES[dtype])
            self._state(c.program, c.protocol, c.split, dtype)
        return c

    def _ensure_scratch(self, nbytes: int) -> None:
        if nbytes <= self._scratch_bytes:
            return
        if self.cp.cuda.get_current_stream().is_capturing():
            raise UserError(f"scratch of {nbytes} bytes needed during graph capture; call prepare() with the "
                            f"largest size before capturing")
        self._scratch = self.cp.empty(nbytes, dtype=self.cp.uint8)
        self._scratch_bytes = nbytes

    # ---- calls ----
    def allreduce(self, send, recv, count, dtype="float32", op="sum", stream=None) -> Choice:
        return self.collective("allreduce", send, recv, count, dtype, op, stream)

    def allgather(self, send, recv, count, dtype="float32", stream=None) -> Choice:
        return self.collective("allgather", send, recv, count, dtype, "sum", stream)

    def reducescatter(self, send, recv, count, dtype="float32", op="sum", stream=None) -> Choice:
        return self.collective("reducescatter", send, recv, count, dtype, op, stream)

    def alltoall(self, send, recv, count, dtype="float32", stream=None) -> Choice:
        return self.collective("alltoall", send, recv, count, dtype, "sum", stream)

    def collective(self, name, send, recv, count, dtype="float32", op="sum", stream=None,
                   choice: Choice | None = None) -> Choice:
        """Run collective ``name`` (NCCL's count convention) on cupy arrays ``send``/``recv``."""
        return self.collective_ptr(name, send.data.ptr, send.nbytes, recv.data.ptr, recv.nbytes, count, dtype, op,
                                   stream, choice)

    def collective_ptr(self, name, sptr: int, sbytes: int, rptr: int, rbytes: int, count, dtype="float32",
                       op="sum", stream=None, choice: Choice | None = None) -> Choice:
        """Run collective ``name`` on device buffers given by address and size in bytes (torch
        tensors, foreign allocations); ``stream``: a cupy stream (cupy.cuda.ExternalStream wraps
        another library's)."""
        cp = self.cp
        stream = stream or cp.cuda.get_current_stream()
        esize = pack.DTYPES.get(dtype)
        if esize is None:
            raise UserError(f"dtype {dtype!r} is not supported; use one of {', '.join(pack.DTYPES)}")
        in_elems, out_elems = pack.buffer_elems(name, count, self.nranks)
        for nbytes, need, label in ((sbytes, in_elems, "send"), (rbytes, out_elems, "receive")):
            if nbytes < need * esize:
                raise UserError(f"{name}: {label} buffer holds {nbytes} bytes, the call needs {need * esize}; "
                                f"pass a larger buffer or a smaller count")
        c = choice or self.choose(name, count, dtype, op)
        if c.uses_nccl:
            self.nccl_collective(name, sptr, rptr, count, dtype, stream)
            return c
        self._run(c, name, sptr, rptr, count, dtype, stream)
        return c

    def nccl_collective(self, name, sptr, rptr, count, dtype, stream) -> None:
        if name not in NCCL_COLLECTIVES:
            raise UserError(f"NCCL has no collective {name!r}; load a program for it")
        if name == "alltoall" and count % self.nranks:
            raise UserError(f"alltoall count {count} is not a multiple of {self.nranks} ranks; pad it")
        device_nccl.launch(self.nccl, Collective.parse(name), sptr, rptr, count, dtype, self.rank, self.nranks,
                           stream.ptr)

    def _run(self, c: Choice, name, sptr, rptr, count, dtype, stream) -> None:
        cp = self.cp
        program, packed = c.program, self._packed[id(c.program)]
        esize = pack.DTYPES[dtype]
        in_elems, out_elems = pack.buffer_elems(name, count, self.nranks)
        r = self.rank
        inplace_call = {"allgather": sptr == rptr + r * count * esize,
                        "reducescatter": rptr == sptr + r * count * esize}.get(name, sptr == rptr)
        if program.inplace and not inplace_call:
            # emulate out-of-place with the in-place program: put the input where the program expects it
            if name == "allreduce":
                cp.cuda.runtime.memcpyAsync(rptr, sptr, count * esize, _D2D, stream.ptr)
                sptr = rptr
            elif name == "allgather":
                cp.cuda.runtime.memcpyAsync(rptr + r * count * esize, sptr, count * esize, _D2D, stream.ptr)
                sptr = rptr + r * count * esize
            else:
                raise UserError(f"program {program.name!r} is in-place; call {name} in place or load an "
                                f"out-of-place program")
        elif not program.inplace and inplace_call:
            raise UserError(f"program {program.name!r} is out-of-place; pass separate send and receive buffers")
        pack.check_buffers(packed, c.chunk, in_elems, out_elems, program.name)
        scratch_bytes = pack.scratch_elems(packed, c.chunk) * esize
        self._ensure_scratch(scratch_bytes)
        st = self._state(program, c.protocol, c.split, dtype)
        fifo = fifo_for(self.preset, c.protocol)
        geo = pack.launch_geometry(c.protocol, esize, fifo.slot_bytes, packed.max_cnt, packed.ntb, c.split,
                                   c.entry.tile_bytes)
        scratch = self._scratch.data.ptr if self._scratch is not None else 0
        args = pack.params(st.image, st.gimg.data.ptr if st.gimg is not None else 0, (sptr, rptr, scratch),
                           c.chunk, geo.split, esize, geo.tile_elems, c.protocol, fifo.slots, fifo.slot_bytes,
                           st.sems.data.ptr, st.epochs.data.ptr)
        with stream:
            self.kernels[(dtype, c.protocol)]((geo.blocks,), (self.preset.threads,), (args,))

    def close(self) -> None:
        cp = self.cp
        cp.cuda.runtime.deviceSynchronize()
        for r, b in enumerate(self.bases):
            if r != self.rank:
                cp.cuda.runtime.ipcCloseMemHandle(b)
        cp.cuda.runtime.free(self.pool)
        self.bases = []
        device_nccl.destroy(self.mpi, cp.cuda.get_current_stream(), [self.nccl])
