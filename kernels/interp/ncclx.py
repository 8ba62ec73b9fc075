"""NCCL through ctypes, on the library CuPy loads: what cupy.cuda.nccl does not
expose (symmetric-memory windows, NCCL 2.27+), plus the three collectives.

    lib = NcclLib.load()                       # the libnccl already mapped in this process
    comm = lib.init_rank(nranks, uid, rank)    # uid = lib.unique_id() on rank 0, broadcast
    ptr = lib.mem_alloc(nbytes); win = lib.window_register(comm, ptr, nbytes)
    lib.collective(comm, "allreduce", sptr, rptr, count, "float32", stream_ptr)
    lib.window_deregister(comm, win); lib.mem_free(ptr); lib.destroy(comm)

A buffer from ``mem_alloc`` registered with ``window_register`` (flag
NCCL_WIN_COLL_SYMMETRIC) on every rank lets NCCL pick its symmetric kernels
when both the send and the receive buffer lie in such windows.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from pathlib import Path

from calibrate.errors import UserError

UNIQUE_ID_BYTES = 128
WIN_COLL_SYMMETRIC = 0x01
NCCL_TYPES = {"float32": 7, "float16": 6, "bfloat16": 9}
NCCL_SUM = 0
SYMMETRIC_MIN_VERSION = 22700   # ncclCommWindowRegister appeared in NCCL 2.27


class _UniqueId(ctypes.Structure):
    # bytes, not c_char: a c_char array field reads back cut at its first zero byte
    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]


def mapped_library(maps_text: str) -> str:
    """The path of the libnccl mapped in a process, from the text of /proc/<pid>/maps ('' if none)."""
    for line in maps_text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and Path(parts[-1]).name.startswith("libnccl.so"):
            return parts[-1]
    return ""


def version_text(code: int) -> str:
    """NCCL's version code (e.g. 22809) as 2.28.9."""
    major, rest = divmod(code, 10000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


@dataclass
class NcclLib:
    lib: ctypes.CDLL
    path: str

    @classmethod
    def load(cls) -> "NcclLib":
        """The libnccl CuPy uses (mapped once cupy.cuda.nccl has made a communicator or is
        imported), else the system's."""
        try:
            from cupy.cuda import nccl  # noqa: F401  (maps the library CuPy is built against)
        except ImportError:
            pass
        try:
            path = mapped_library(Path("/proc/self/maps").read_text())
        except OSError:
            path = ""
        path = path or ctypes.util.find_library("nccl") or ""
        if not path:
            raise UserError("no NCCL library found (libnccl.so); install nvidia-nccl-cu13 or cupy with NCCL")
        lib = ctypes.CDLL(path)
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        return cls(lib, path)

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise UserError(f"{what} failed: NCCL error {rc} ({self.lib.ncclGetErrorString(rc).decode()})")

    def version(self) -> int:
        v = ctypes.c_int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def has_windows(self) -> bool:
        return self.version() >= SYMMETRIC_MIN_VERSION and hasattr(self.lib, "ncclCommWindowRegister")

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def init_rank(self, nranks: int, uid: bytes, rank: int) -> int:
        comm = ctypes.c_void_p()
        if len(uid) != UNIQUE_ID_BYTES:
            raise UserError(f"NCCL unique id of {len(uid)} bytes, expected {UNIQUE_ID_BYTES}; pass unique_id()'s")
        u = _UniqueId()
        ctypes.memmove(ctypes.byref(u), uid, UNIQUE_ID_BYTES)
        self._check(self.lib.ncclCommInitRank(ctypes.byref(comm), ctypes.c_int(nranks), u, ctypes.c_int(rank)),
                    "ncclCommInitRank")
        return comm.value

    def destroy(self, comm: int) -> None:
        self._check(self.lib.ncclCommDestroy(ctypes.c_void_p(comm)), "ncclCommDestroy")

    def mem_alloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self._check(self.lib.ncclMemAlloc(ctypes.byref(p), ctypes.c_size_t(nbytes)), "ncclMemAlloc")
        return p.value

    def mem_free(self, ptr: int) -> None:
        self._check(self.lib.ncclMemFree(ctypes.c_void_p(ptr)), "ncclMemFree")

    def window_register(self, comm: int, ptr: int, nbytes: int) -> int:
        win = ctypes.c_void_p()
        self._check(self.lib.ncclCommWindowRegister(ctypes.c_void_p(comm), ctypes.c_void_p(ptr),
                                                    ctypes.c_size_t(nbytes), ctypes.byref(win),
                                                    ctypes.c_int(WIN_COLL_SYMMETRIC)), "ncclCommWindowRegister")
        return win.value

    def window_deregister(self, comm: int, win: int) -> None:
        self._check(self.lib.ncclCommWindowDeregister(ctypes.c_void_p(comm), ctypes.c_void_p(win)),
                    "ncclCommWindowDeregister")

    def collective(self, comm: int, name: str, sptr: int, rptr: int, count: int, dtype: str, stream: int) -> None:
        """NCCL's ``name`` with NCCL's count convention (allgather: send count; reducescatter: receive count)."""
        t = ctypes.c_int(NCCL_TYPES[dtype])
        s, r, n = ctypes.c_void_p(sptr), ctypes.c_void_p(rptr), ctypes.c_size_t(count)
        c, st = ctypes.c_void_p(comm), ctypes.c_void_p(stream)
        if name == "allreduce":
            rc = self.lib.ncclAllReduce(s, r, n, t, ctypes.c_int(NCCL_SUM), c, st)
        elif name == "allgather":
            rc = self.lib.ncclAllGather(s, r, n, t, c, st)
        elif name == "reducescatter":
            rc = self.lib.ncclReduceScatter(s, r, n, t, ctypes.c_int(NCCL_SUM), c, st)
        else:
            raise UserError(f"no NCCL collective {name!r} here; use allreduce, allgather or reducescatter")
        self._check(rc, f"nccl {name}")
