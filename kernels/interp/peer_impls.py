"""The peers the interpreter is measured against, one class each behind a registry
(``PEERS``): the interpreter's tuned table, NCCL (default or the environment's
setting), NCCL's symmetric kernels on registered windows, and PyTorch
SymmetricMemory's one-shot, two-shot and copy-engine (low-contention) kernels.

Every peer owns (or shares) buffers of the largest size, gives their addresses,
and launches one call on a cupy stream; ``capture`` returns a CUDA graph of n
calls with ``launch(stream)``, so that one timer serves all. A peer that cannot
run here raises ``PeerUnavailable`` with the reason, which the record keeps.
Needs a GPU; torch is imported only by the torch peers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kernels.interp import gpudata, pack

COLLECTIVES = ("allreduce", "allgather", "reducescatter")


class PeerUnavailable(Exception):
    """This peer cannot run on this machine or for this call (the message says why)."""


@dataclass
class Ctx:
    """What the peers share: MPI, the interpreter's communicator, the plain buffers."""

    world: object
    cp: object
    interp: object          # kernels.interp.runtime.Communicator
    dtype: str
    max_bytes: int
    device_index: int
    plain: tuple = ()       # (send, recv) cupy arrays of max_bytes each
    _torch_group: object = None
    extra: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def nranks(self) -> int:
        return self.world.Get_size()

    @property
    def esize(self) -> int:
        return pack.DTYPES[self.dtype]

    def plain_buffers(self):
        if not self.plain:
            n = self.max_bytes // self.esize
            self.plain = (gpudata.empty(self.cp, self.dtype, n), gpudata.empty(self.cp, self.dtype, n))
        return self.plain

    def torch_group(self):
        if self._torch_group is None:
            from kernels.interp.torch_comm import init_torch_from_mpi

            self._torch_group = init_torch_from_mpi(self.world, self.device_index)
        return self._torch_group


class CudaGraph:
    """A cupy-captured graph of n calls (the peer's ``launch`` on a capturing stream)."""

    def __init__(self, stream, call, n: int):
        stream.begin_capture()
        try:
            for _ in range(n):
                call(stream)
        finally:
            graph = stream.end_capture()
        self.graph = graph
        self.launch(stream)
        stream.synchronize()

    def launch(self, stream) -> None:
        self.graph.launch(stream)


class Peer:
    name = ""
    collectives: tuple[str, ...] = COLLECTIVES

    def __init__(self, ctx: Ctx):
        self.ctx = ctx

    def buffers(self, coll: str, count: int) -> tuple[int, int]:
        """(send address, receive address) for a call of ``count`` (NCCL's convention)."""
        s, r = self.ctx.plain_buffers()
        return s.data.ptr, r.data.ptr

    def prepare(self, coll: str, count: int) -> str:
        """Anything to do outside capture before calls of this size; returns a detail for the record."""
        return ""

    def launch(self, coll: str, count: int, stream) -> int:
        """One call on cupy ``stream``; returns the address of its result."""
        raise NotImplementedError

    def capture(self, coll: str, count: int, stream, n: int):
        return CudaGraph(stream, lambda s: self.launch(coll, count, s), n)

    def close(self) -> None:
        pass


class InterpPeer(Peer):
    """The interpreter with its tuned table (kernels/interp/presets), NCCL outside it; with
    ``preset``, a candidate table on a communicator of its own (peer ``interp[PRESET]``)."""

    name = "interp"

    def __init__(self, ctx: Ctx, preset: str | None = None):
        super().__init__(ctx)
        self.comm = ctx.interp
        if preset is not None:
            from kernels.interp.runtime import Communicator

            self.comm = Communicator(ctx.world, preset)
            self.name = f"interp[{self.comm.preset.name}]"
            self.collectives = tuple(c for c in COLLECTIVES if any(p.collective == c for _, p in self.comm.loaded))

    def prepare(self, coll, count):
        c = self.comm.prepare(coll, count, self.ctx.dtype)
        self._choice = c
        return "nccl (outside the table)" if c.uses_nccl else \
            f"{c.program.name} {c.protocol.value} split {c.split}"

    def launch(self, coll, count, stream):
        s, r = self.buffers(coll, count)
        nb = self.ctx.max_bytes
        self.comm.collective_ptr(coll, s, nb, r, nb, count, self.ctx.dtype, stream=stream, choice=self._choice)
        return r

    def close(self):
        if self.comm is not self.ctx.interp:
            self.comm.close()


class NcclPeer(Peer):
    """NCCL as configured by the environment (default: no NCCL_* tuning variables set)."""

    name = "nccl"

    def launch(self, coll, count, stream):
        s, r = self.buffers(coll, count)
        self.ctx.interp.nccl_collective(coll, s, r, count, self.ctx.dtype, stream)
        return r


class NcclSymmPeer(Peer):
    """NCCL 2.27+ symmetric kernels: both buffers from ncclMemAlloc, registered as
    NCCL_WIN_COLL_SYMMETRIC windows on a communicator of their own."""

    name = "nccl-symm"

    def __init__(self, ctx):
        super().__init__(ctx)
        from kernels.interp.ncclx import NcclLib, version_text

        self.lib = NcclLib.load()
        if not self.lib.has_windows():
            raise PeerUnavailable(f"NCCL {version_text(self.lib.version())} at {self.lib.path} has no "
                                  f"ncclCommWindowRegister (needs 2.27+)")
        uid = ctx.world.bcast(self.lib.unique_id() if ctx.rank == 0 else None, root=0)
        self.comm = self.lib.init_rank(ctx.nranks, uid, ctx.rank)
        self.ptrs = [self.lib.mem_alloc(ctx.max_bytes) for _ in range(2)]
        self.wins = [self.lib.window_register(self.comm, p, ctx.max_bytes) for p in self.ptrs]
        ctx.cp.cuda.runtime.deviceSynchronize()
        ctx.world.Barrier()

    def buffers(self, coll, count):
        return self.ptrs[0], self.ptrs[1]

    def launch(self, coll, count, stream):
        self.lib.collective(self.comm, coll, self.ptrs[0], self.ptrs[1], count, self.ctx.dtype, stream.ptr)
        return self.ptrs[1]

    def close(self):
        self.ctx.cp.cuda.runtime.deviceSynchronize()
        for w in self.wins:
            self.lib.window_deregister(self.comm, w)
        for p in self.ptrs:
            self.lib.mem_free(p)
        self.lib.destroy(self.comm)


class TorchGraph:
    """``n`` calls captured with torch.cuda.graph, replayed on a cupy stream."""

    def __init__(self, torch, call, n: int, stream):
        self.torch = torch
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.graph(self.graph, stream=side):
            for _ in range(n):
                call()
        self.launch(stream)
        stream.synchronize()

    def launch(self, stream) -> None:
        with self.torch.cuda.stream(self.torch.cuda.ExternalStream(stream.ptr)):
            self.graph.replay()


class TorchSymmPeer(Peer):
    """PyTorch SymmetricMemory (CUDA backend, multicast off): the input in symmetric memory
    (allocated and rendezvoused once), the output a plain torch tensor."""

    op = ""

    def __init__(self, ctx):
        super().__init__(ctx)
        import os

        import torch

        if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
            raise PeerUnavailable("TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is not set (multicast must stay off)")
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as e:
            raise PeerUnavailable(f"torch has no SymmetricMemory ({e})") from None
        if not hasattr(torch.ops.symm_mem, self.op):
            raise PeerUnavailable(f"torch {torch.__version__} has no symm_mem.{self.op}")
        group = ctx.torch_group()
        self.torch, self.gname = torch, group.group_name
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[ctx.dtype]
        n = ctx.max_bytes // ctx.esize
        bufs = ctx.extra.get("torch_symm")
        if bufs is None:   # one symmetric input and one output, shared by the torch peers
            if hasattr(symm_mem, "set_backend"):
                try:
                    symm_mem.set_backend("CUDA")
                except Exception:  # noqa: BLE001  (already set by an earlier allocation: kept as it is)
                    pass
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(self.gname)
            inp = symm_mem.empty(n, dtype=tdt, device=torch.device("cuda", ctx.device_index))
            symm_mem.rendezvous(inp, group)
            bufs = ctx.extra["torch_symm"] = (inp, torch.empty(n, dtype=tdt, device=inp.device))
        self.inp, self.out = bufs
        self.result = None

    def buffers(self, coll, count):
        return self.inp.data_ptr(), self.out.data_ptr()

    def _views(self, coll, count):
        in_n, out_n = pack.buffer_elems(coll, count, self.ctx.nranks)
        return self.inp[:in_n], self.out[:out_n]

    def call(self, coll, count):
        """The op on torch's current stream; returns the result tensor."""
        raise NotImplementedError

    def close(self):
        self.inp = self.out = self.result = None

    def launch(self, coll, count, stream):
        torch = self.torch
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
            self.result = self.call(coll, count)
        return self.result.data_ptr()

    def capture(self, coll, count, stream, n):
        return TorchGraph(self.torch, lambda: self.call(coll, count), n, stream)


class TorchOneShot(TorchSymmPeer):
    name, op, collectives = "torch-oneshot", "one_shot_all_reduce_out", ("allreduce",)

    def call(self, coll, count):
        i, o = self._views(coll, count)
        return self.torch.ops.symm_mem.one_shot_all_reduce_out(i, "sum", self.gname, o)


class TorchTwoShot(TorchSymmPeer):
    name, op, collectives = "torch-twoshot", "two_shot_all_reduce_out", ("allreduce",)

    def call(self, coll, count):
        i, o = self._views(coll, count)
        return self.torch.ops.symm_mem.two_shot_all_reduce_out(i, "sum", self.gname, o)


class TorchReduceScatter(TorchSymmPeer):
    name, op, collectives = "torch-rs", "reduce_scatter_out", ("reducescatter",)

    def call(self, coll, count):
        i, o = self._views(coll, count)
        return self.torch.ops.symm_mem.reduce_scatter_out(i, self.gname, False, o)


class TorchLowContention(TorchSymmPeer):
    """Copy engines pull the peers' symmetric buffers (no SMs for allgather)."""

    name, op, collectives = "torch-lowcontention", "_low_contention_all_gather", ("allgather", "reducescatter")

    def call(self, coll, count):
        i, _ = self._views(coll, count)
        ops = self.torch.ops.symm_mem
        r = ops._low_contention_all_gather(i, self.gname) if coll == "allgather" else \
            ops._low_contention_reduce_scatter(i, "sum", self.gname)
        return self.torch.ops._c10d_functional.wait_tensor(r)   # joins the copy engines' stream


PEERS: dict[str, type[Peer]] = {p.name: p for p in (InterpPeer, NcclPeer, NcclSymmPeer, TorchOneShot, TorchTwoShot,
                                                     TorchReduceScatter, TorchLowContention)}
