"""The compiler's last pass: thread blocks' steps in the step order and cross-thread-block
dependencies, as an ``IRTable``; O(N log N + E log E) for N instructions and E dependencies (sorts by
thread block and by (waiting step, producing thread block)), no Python per step."""
from __future__ import annotations

import numpy as np

from kernels.gc3.arrays import order_by
from kernels.gc3.ir import Buffer
from kernels.gc3.table import IRTable
from kernels.gc3.threadblocks import Placed


def _buffer_sizes(prog) -> np.ndarray:
    spec, n = prog.spec, prog.instances
    sizes = np.zeros((spec.ranks, 3), dtype=np.int64)
    for r in range(spec.ranks):
        sizes[r] = ((spec.buffer_chunks(r, Buffer.INPUT) or 0) * n, (spec.buffer_chunks(r, Buffer.OUTPUT) or 0) * n,
                    int(prog.scratch_chunks[r]) * n)
    if spec.inplace and spec.kind in ("allreduce", "reducescatter"):
        sizes[:, 1] = 0
    if spec.inplace and spec.kind == "allgather":
        sizes[:, 0] = 0
    return sizes


def emit(prog, ins, dep_src: np.ndarray, dep_dst: np.ndarray, placed: Placed, nlanes: int,
         seq: np.ndarray) -> IRTable:
    """The IR of placed instructions ``ins`` run in the order ``seq``."""
    spec = prog.spec
    R, N, T = spec.ranks, len(ins), len(placed.tb_rank)
    tb_first = np.searchsorted(placed.tb_rank, np.arange(R))
    tb_id = np.arange(T) - tb_first[placed.tb_rank]
    by = seq[order_by(placed.tb[seq])]       # instructions by thread block, then step
    step_tb = placed.tb[by]
    tb_start = np.zeros(T + 1, dtype=np.int64)
    np.cumsum(np.bincount(step_tb, minlength=T), out=tb_start[1:])
    row_of = np.empty(N, dtype=np.int64)
    row_of[by] = np.arange(N)
    step_of = row_of - tb_start[placed.tb]
    cross = placed.tb[dep_src] != placed.tb[dep_dst]
    ds, dd = dep_src[cross], dep_dst[cross]
    key = row_of[dd] * T + placed.tb[ds]
    order = order_by(key, step_of[ds])
    key, ds = key[order], ds[order]
    last = np.ones(len(key), dtype=bool)
    last[:-1] = key[1:] != key[:-1]
    key, ds = key[last], ds[last]
    waiter, producer_tb = np.divmod(key, T)
    dep_start = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(np.bincount(waiter, minlength=N), out=dep_start[1:])
    hasdep = np.zeros(N, dtype=bool)
    hasdep[row_of[ds]] = True
    return IRTable(
        name=prog.name, collective=spec.kind, ngpus=R, nchunksperloop=spec.chunks * prog.instances,
        nchannels=placed.nchannels * nlanes, protocol=prog.protocol, inplace=spec.inplace, min_bytes=0,
        max_bytes=0, gpu_chunks=_buffer_sizes(prog), gpu_id=np.arange(R), tb_gpu=placed.tb_rank, tb_id=tb_id,
        tb_send=placed.tb_send, tb_recv=placed.tb_recv, tb_chan=placed.tb_chan, tb_start=tb_start,
        st_type=ins.type[by].astype(np.int8), st_srcbuf=ins.src_buf[by].astype(np.int8), st_srcoff=ins.src_idx[by],
        st_dstbuf=ins.dst_buf[by].astype(np.int8), st_dstoff=ins.dst_idx[by], st_cnt=ins.cnt[by], st_hasdep=hasdep,
        dep_start=dep_start, dep_tb=tb_id[producer_tb], dep_step=step_of[ds])
