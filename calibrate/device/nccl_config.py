"""NCCL communicators with a per-communicator channel configuration, through ctypes on
the very libnccl that cupy loaded (``calibrate.device.nccl.communicator(..., min_ctas=N)``).

NCCL reads NCCL_MIN_NCHANNELS, NCCL_MAX_NCHANNELS, NCCL_MIN_CTAS and NCCL_MAX_CTAS once
per process (NCCL_PARAM caches them), so one process cannot hold a communicator with
NCCL's default channels and one with 64 through the environment. ``ncclConfig_t``'s
minCTAs/maxCTAs are per communicator (``ncclCommInitRankConfig``), and NCCL_MIN_CTAS in a
job's environment sets the same field: what the tuned communicators here are made with is
what a job that sources the env file gets.

``Communicator`` has the methods of cupy's ``NcclCommunicator`` that
``calibrate.device.nccl.launch`` calls, so every launch runs on it unchanged.
"""
from __future__ import annotations

import ctypes
import os

from calibrate.errors import OptionError, UserError

UNDEF_INT = -(1 << 31)        # NCCL_CONFIG_UNDEF_INT
CONFIG_MAGIC = 0xCAFEBEEF
CONFIG_VERSION = 21700        # NCCL_VERSION(2, 17, 0): the fields below; later ones keep NCCL's defaults
MAX_CHANNELS = 64             # NCCL's MAXCHANNELS (2.28)


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):
    """The head of ncclConfig_t (NCCL >= 2.17); NCCL copies ``size`` bytes and defaults the rest."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int)]


def make_config(min_ctas: int) -> Config:
    if not 1 <= min_ctas <= MAX_CHANNELS:
        raise OptionError("min_ctas", f"{min_ctas}: NCCL takes 1..{MAX_CHANNELS}")
    return Config(ctypes.sizeof(Config), CONFIG_MAGIC, CONFIG_VERSION, UNDEF_INT, UNDEF_INT, min_ctas,
                  MAX_CHANNELS, None, UNDEF_INT)


def loaded_path(name: str = "libnccl.so") -> str | None:
    """The path of the loaded library whose file name starts with ``name`` (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and os.path.basename(parts[-1]).startswith(name):
                    return parts[-1]
    except OSError:
        return None
    return None


class Library:
    """libnccl as cupy loaded it (or the soname when cupy's is not found)."""

    def __init__(self, cupy_nccl):
        self.version = cupy_nccl.get_version()  # loads the library if cupy defers it
        self.path = loaded_path() or "libnccl.so.2"
        self.lib = ctypes.CDLL(self.path)
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        got = ctypes.c_int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(got)), "ncclGetVersion")
        if got.value < CONFIG_VERSION:
            raise UserError(f"NCCL {got.value} has no per-communicator channel configuration: use NCCL 2.17 or later")
        c = self.lib
        c.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int,
                                             ctypes.POINTER(Config)]
        c.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        c.ncclAllReduce.argtypes = [vp, vp, sz, i, i, vp, vp]
        c.ncclReduceScatter.argtypes = [vp, vp, sz, i, i, vp, vp]
        c.ncclAllGather.argtypes = [vp, vp, sz, i, vp, vp]
        c.ncclBroadcast.argtypes = [vp, vp, sz, i, i, vp, vp]
        c.ncclSend.argtypes = [vp, sz, i, i, vp, vp]
        c.ncclRecv.argtypes = [vp, sz, i, i, vp, vp]
        c.ncclCommDestroy.argtypes = [vp]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            try:
                why = self.lib.ncclGetErrorString(rc).decode()
            except Exception:  # noqa: BLE001  (the message is a courtesy; the code is what matters)
                why = f"error {rc}"
            raise RuntimeError(f"{what} failed: {why}")

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self._check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid))

    def communicator(self, mpi_comm, min_ctas: int | None = None) -> "Communicator":
        """A communicator over the ranks of ``mpi_comm`` (collective); ``min_ctas``: at least that many
        channels (ncclConfig_t.minCTAs, maxCTAs 64), None: NCCL's defaults (ncclCommInitRank)."""
        if min_ctas is not None:
            make_config(min_ctas)  # refused before any rank enters NCCL
        raw = mpi_comm.bcast(self.unique_id() if mpi_comm.Get_rank() == 0 else None, root=0)
        uid = UniqueId()
        ctypes.memmove(ctypes.addressof(uid), raw, len(raw))
        handle = ctypes.c_void_p()
        n, r = mpi_comm.Get_size(), mpi_comm.Get_rank()
        if min_ctas is None:
            rc = self.lib.ncclCommInitRank(ctypes.byref(handle), n, uid, r)
        else:
            config = make_config(min_ctas)
            rc = self.lib.ncclCommInitRankConfig(ctypes.byref(handle), n, uid, r, ctypes.byref(config))
        self._check(rc, "ncclCommInitRank")
        return Communicator(self, handle)


class Communicator:
    """One NCCL communicator; the call shapes of cupy.cuda.nccl.NcclCommunicator."""

    def __init__(self, library: Library, handle: ctypes.c_void_p):
        self._lib = library
        self.comm = handle

    def _call(self, name: str, *args) -> None:
        self._lib._check(getattr(self._lib.lib, name)(*args), name)

    def allReduce(self, send, recv, count, dtype, op, stream):
        self._call("ncclAllReduce", send, recv, count, dtype, op, self.comm, stream)

    def reduceScatter(self, send, recv, recvcount, dtype, op, stream):
        self._call("ncclReduceScatter", send, recv, recvcount, dtype, op, self.comm, stream)

    def allGather(self, send, recv, count, dtype, stream):
        self._call("ncclAllGather", send, recv, count, dtype, self.comm, stream)

    def broadcast(self, send, recv, count, dtype, root, stream):
        self._call("ncclBroadcast", send, recv, count, dtype, root, self.comm, stream)

    def send(self, buf, count, dtype, peer, stream):
        self._call("ncclSend", buf, count, dtype, peer, self.comm, stream)

    def recv(self, buf, count, dtype, peer, stream):
        self._call("ncclRecv", buf, count, dtype, peer, self.comm, stream)

    def destroy(self):
        if self.comm:
            self._call("ncclCommDestroy", self.comm)
            self.comm = None
