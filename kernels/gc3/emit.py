"""The compiler's last pass: thread blocks' steps in the step order and cross-thread-block
dependencies, as an ``IRTable``; O(N log N + E log E) for N instructions and E dependencies (sorts by
thread block and by (waiting step, producing thread block)), no Python per step."""
from __future__ import annotations

import numpy as np

from kernels.gc3.arrays import bit_width, order_by
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


def _cross_dependencies(waiter: np.ndarray, tb: np.ndarray, step: np.ndarray):
    """Per (waiting step row, producing thread block of its GPU), the last producing step: (waiter, thread block,
    step) sorted by waiter then thread block. One sort of (waiter, thread block, step) codes (no positions,
    no argsort) when they fit in 63 bits, else a lexsort. ``waiter`` is used up (it becomes the codes)."""
    tb_bits = bit_width(int(tb.max(initial=0)) + 1)
    step_bits = bit_width(int(step.max(initial=0)) + 1)
    if int(waiter.max(initial=0)) < 1 << (63 - tb_bits - step_bits):
        code = waiter
        del waiter
        code <<= tb_bits
        code |= tb
        del tb
        code <<= step_bits
        code |= step
        del step
        code.sort()
        group = code >> step_bits
        last = np.ones(len(code), dtype=bool)
        last[:-1] = group[1:] != group[:-1]
        group = group[last]
        return group >> tb_bits, group & ((1 << tb_bits) - 1), code[last] & ((1 << step_bits) - 1)
    order = np.lexsort((step, tb, waiter))
    waiter, tb, step = waiter[order], tb[order], step[order]
    last = np.ones(len(waiter), dtype=bool)
    last[:-1] = (waiter[1:] != waiter[:-1]) | (tb[1:] != tb[:-1])
    return waiter[last], tb[last], step[last]


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
    cross = placed.tb[dep_src] != placed.tb[dep_dst]
    waiting, producing = row_of[dep_dst[cross]], dep_src[cross]
    del cross
    producer_row = placed.tb[producing]
    producer_step = row_of[producing] - tb_start[producer_row]      # step index: row - first row of its tb
    del row_of, producing
    producer_row = tb_id[producer_row]
    waiter, producer_tb, dep_step = _cross_dependencies(waiting, producer_row, producer_step)
    del waiting, producer_row, producer_step
    dep_start = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(np.bincount(waiter, minlength=N), out=dep_start[1:])
    hasdep = np.zeros(N, dtype=bool)
    hasdep[tb_start[tb_first[placed.tb_rank[step_tb[waiter]]] + producer_tb] + dep_step] = True
    del step_tb, waiter
    return IRTable(
        name=prog.name, collective=spec.kind, ngpus=R, nchunksperloop=spec.chunks * prog.instances,
        nchannels=placed.nchannels * nlanes, protocol=prog.protocol, inplace=spec.inplace, min_bytes=0,
        max_bytes=0, gpu_chunks=_buffer_sizes(prog), gpu_id=np.arange(R), tb_gpu=placed.tb_rank, tb_id=tb_id,
        tb_send=placed.tb_send, tb_recv=placed.tb_recv, tb_chan=placed.tb_chan, tb_start=tb_start,
        st_type=ins.type[by].astype(np.int8, copy=False), st_srcbuf=ins.src_buf[by].astype(np.int8, copy=False),
        st_srcoff=ins.src_idx[by], st_dstbuf=ins.dst_buf[by].astype(np.int8, copy=False), st_dstoff=ins.dst_idx[by],
        st_cnt=ins.cnt[by], st_hasdep=hasdep,
        dep_start=dep_start, dep_tb=producer_tb, dep_step=dep_step)
