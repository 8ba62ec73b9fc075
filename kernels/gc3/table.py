"""The IR in columns (``IRTable``): one numpy row per thread block and per step.

It holds what ``ir.Program`` holds (same schema: algo > gpu > tb > step) in
arrays, so that programs of millions of steps are compiled, verified and
written without a Python object per step. Thread blocks are rows sorted by
(GPU, position in the GPU); a thread block's steps are the rows
``tb_start[t]:tb_start[t + 1]``; a step's dependencies are the rows
``dep_start[k]:dep_start[k + 1]`` of ``dep_tb`` (thread block id on the same
GPU) and ``dep_step`` (step index). Step types and buffers are codes: indexes
into ``STEP_TYPES`` and ``BUFFERS``.

``from_program`` and ``to_program`` convert from and to the object form; both
are O(S + D) for S steps and D dependencies.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.gc3.ir import RECEIVING, SENDING, Buffer, Gpu, Program, Protocol, Step, StepType, ThreadBlock

STEP_TYPES = list(StepType)
BUFFERS = list(Buffer)
TYPE_CODE = {t: k for k, t in enumerate(STEP_TYPES)}
BUFFER_CODE = {b: k for k, b in enumerate(BUFFERS)}
SENDS = np.array([t in SENDING for t in STEP_TYPES])
RECEIVES = np.array([t in RECEIVING for t in STEP_TYPES])

_HEADER = ("name", "collective", "ngpus", "nchunksperloop", "nchannels", "protocol", "inplace", "min_bytes",
           "max_bytes")


@dataclass
class IRTable:
    name: str
    collective: str
    ngpus: int
    nchunksperloop: int
    nchannels: int
    protocol: Protocol
    inplace: bool
    min_bytes: int
    max_bytes: int
    gpu_chunks: np.ndarray   # (GPUs listed, 3): i_chunks, o_chunks, s_chunks; row k is GPU id gpu_id[k]
    gpu_id: np.ndarray
    tb_gpu: np.ndarray       # row of gpu_chunks of each thread block
    tb_id: np.ndarray
    tb_send: np.ndarray
    tb_recv: np.ndarray
    tb_chan: np.ndarray
    tb_start: np.ndarray     # (T + 1,) first step row of each thread block
    st_type: np.ndarray      # int8 codes into STEP_TYPES
    st_srcbuf: np.ndarray    # int8 codes into BUFFERS
    st_srcoff: np.ndarray
    st_dstbuf: np.ndarray
    st_dstoff: np.ndarray
    st_cnt: np.ndarray
    st_hasdep: np.ndarray    # bool
    dep_start: np.ndarray    # (S + 1,)
    dep_tb: np.ndarray
    dep_step: np.ndarray

    @property
    def steps(self) -> int:
        return len(self.st_type)

    @property
    def max_threadblocks(self) -> int:
        return int(np.bincount(self.tb_gpu, minlength=1).max()) if len(self.tb_gpu) else 0

    def step_tb(self) -> np.ndarray:
        """The thread block row of every step."""
        return np.repeat(np.arange(len(self.tb_gpu)), np.diff(self.tb_start))

    def tb_row(self, gpu_row: np.ndarray, tb_id: np.ndarray) -> np.ndarray:
        """Thread block rows of (gpu row, thread block id) pairs; -1 where there is none."""
        gpu_row, tb_id = np.asarray(gpu_row, dtype=np.int64), np.asarray(tb_id, dtype=np.int64)
        first = np.searchsorted(self.tb_gpu, np.arange(len(self.gpu_id)))
        count = np.bincount(self.tb_gpu, minlength=len(self.gpu_id))
        if len(self.tb_gpu) and (np.diff(self.tb_gpu) >= 0).all() and (self.tb_id == np.arange(len(self.tb_id)) - first[self.tb_gpu]).all():
            return np.where((tb_id >= 0) & (tb_id < count[gpu_row]), first[gpu_row] + tb_id, -1)   # ids 0..k-1
        key = self.tb_gpu.astype(np.int64) * (1 << 32) + self.tb_id
        order = np.argsort(key, kind="stable")
        want = np.asarray(gpu_row, dtype=np.int64) * (1 << 32) + np.asarray(tb_id, dtype=np.int64)
        pos = np.minimum(np.searchsorted(key[order], want), len(key) - 1) if len(key) else np.zeros(len(want), int)
        found = (key[order][pos] == want) if len(key) else np.zeros(len(want), bool)
        return np.where(found, order[pos] if len(key) else -1, -1)

    def step_name(self, k: int) -> str:
        """``gpu R tb T step I (type)`` of step row ``k``, as the executor names steps."""
        t = int(np.searchsorted(self.tb_start, k, side="right")) - 1
        return (f"gpu {int(self.gpu_id[self.tb_gpu[t]])} tb {int(self.tb_id[t])} step {k - int(self.tb_start[t])} "
                f"({STEP_TYPES[self.st_type[k]].value})")

    @classmethod
    def from_program(cls, program: Program) -> "IRTable":
        tb_rows = [(k, tb) for k, g in enumerate(program.gpus) for tb in g.threadblocks]
        steps = [st for _, tb in tb_rows for st in tb.steps]
        n = len(steps)

        def col(values, dtype):
            return np.fromiter(values, dtype=dtype, count=n)
        ndeps = col((len(st.deps) for st in steps), np.int64)
        return cls(
            **{k: getattr(program, k) for k in _HEADER},
            gpu_chunks=np.array([(g.i_chunks, g.o_chunks, g.s_chunks) for g in program.gpus],
                                dtype=np.int64).reshape(-1, 3),
            gpu_id=np.array([g.id for g in program.gpus], dtype=np.int64),
            tb_gpu=np.array([k for k, _ in tb_rows], dtype=np.int64),
            tb_id=np.array([tb.id for _, tb in tb_rows], dtype=np.int64),
            tb_send=np.array([tb.send for _, tb in tb_rows], dtype=np.int64),
            tb_recv=np.array([tb.recv for _, tb in tb_rows], dtype=np.int64),
            tb_chan=np.array([tb.chan for _, tb in tb_rows], dtype=np.int64),
            tb_start=np.concatenate(([0], np.cumsum([len(tb.steps) for _, tb in tb_rows], dtype=np.int64))),
            st_type=col((TYPE_CODE[st.type] for st in steps), np.int8),
            st_srcbuf=col((BUFFER_CODE[st.srcbuf] for st in steps), np.int8),
            st_srcoff=col((st.srcoff for st in steps), np.int64),
            st_dstbuf=col((BUFFER_CODE[st.dstbuf] for st in steps), np.int8),
            st_dstoff=col((st.dstoff for st in steps), np.int64),
            st_cnt=col((st.cnt for st in steps), np.int64),
            st_hasdep=col((st.has_dep for st in steps), bool),
            dep_start=np.concatenate(([0], np.cumsum(ndeps))),
            dep_tb=np.fromiter((d[0] for st in steps for d in st.deps), dtype=np.int64, count=int(ndeps.sum())),
            dep_step=np.fromiter((d[1] for st in steps for d in st.deps), dtype=np.int64, count=int(ndeps.sum())),
        )

    def to_program(self) -> Program:
        out = Program(**{k: getattr(self, k) for k in _HEADER})
        types = [STEP_TYPES[c] for c in self.st_type.tolist()]
        srcbuf = [BUFFERS[c] for c in self.st_srcbuf.tolist()]
        dstbuf = [BUFFERS[c] for c in self.st_dstbuf.tolist()]
        srcoff, dstoff, cnt = self.st_srcoff.tolist(), self.st_dstoff.tolist(), self.st_cnt.tolist()
        hasdep, dstart = self.st_hasdep.tolist(), self.dep_start.tolist()
        dtb, dstep = self.dep_tb.tolist(), self.dep_step.tolist()
        for k, (i, o, s) in enumerate(self.gpu_chunks.tolist()):
            out.gpus.append(Gpu(int(self.gpu_id[k]), i, o, s))
        tstart = self.tb_start.tolist()
        for t, (g, tid, send, recv, chan) in enumerate(zip(self.tb_gpu.tolist(), self.tb_id.tolist(),
                                                            self.tb_send.tolist(), self.tb_recv.tolist(),
                                                            self.tb_chan.tolist())):
            steps = [Step(k - tstart[t], types[k], srcbuf[k], srcoff[k], dstbuf[k], dstoff[k], cnt[k],
                          deps=list(zip(dtb[dstart[k]:dstart[k + 1]], dstep[dstart[k]:dstart[k + 1]])),
                          has_dep=hasdep[k])
                     for k in range(tstart[t], tstart[t + 1])]
            out.gpus[g].threadblocks.append(ThreadBlock(tid, send, recv, chan, steps))
        return out
