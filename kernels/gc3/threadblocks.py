"""Thread blocks of placed instructions, built with sorts and joins of integer codes (see
``kernels.gc3.placement`` for the rules); O(N log N + E) for N instructions and E dependencies."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.gc3.arrays import index_of, isin, order_by, rank_in_group as _rank_in_group, unique, unique_counts



@dataclass
class Placed:
    """Every instruction's thread block, and the thread blocks of every rank."""

    tb: np.ndarray          # per instruction: thread block row (rows sorted by rank, then id)
    tb_rank: np.ndarray     # per thread block
    tb_send: np.ndarray
    tb_recv: np.ndarray
    tb_chan: np.ndarray
    nchannels: int          # virtual channels used (per lane)


def _latest_producers(ins, dep_src: np.ndarray, dep_dst: np.ndarray, pos: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Per instruction, the communicating instruction whose thread block a local one joins (its latest
    producer in the global order, followed through local producers), itself for the others and for local
    instructions without a producer."""
    n = len(ins)
    best = np.arange(n)
    into_local = local[dep_dst]
    d_src, d_dst = dep_src[into_local], dep_dst[into_local]
    if len(d_dst):
        by = order_by(d_dst, pos[d_src])
        last = np.ones(len(by), dtype=bool)
        last[:-1] = d_dst[by][1:] != d_dst[by][:-1]
        best[d_dst[by][last]] = d_src[by][last]
    del d_src, d_dst
    loc_ids = np.flatnonzero(local)
    b = best[loc_ids]
    while True:     # follow producers through local instructions (pointer jumping)
        nxt = best[b]
        if (nxt == b).all():
            break
        best[loc_ids] = b = nxt
    return best


def _candidates(ins, key: np.ndarray, orphan: np.ndarray, R: int, P: int):
    """The thread blocks (key, send peer, receive peer), sorted by key, then category, then order within
    the category."""
    tied = (ins.send >= 0) & (ins.recv >= 0)
    t_code = unique((key[tied] * P + ins.send[tied] + 1) * P + ins.recv[tied] + 1)
    t_key, t_s, t_r = t_code // (P * P), t_code // P % P - 1, t_code % P - 1
    sends, recvs = ins.send >= 0, ins.recv >= 0
    s_code, s_count = unique_counts(key[sends] * R + ins.send[sends])
    r_code, r_count = unique_counts(key[recvs] * R + ins.recv[recvs])
    del sends, recvs
    free_s = ~isin(s_code, unique(t_key * R + t_s))
    free_r = ~isin(r_code, unique(t_key * R + t_r))
    single_s = s_code[free_s & (s_count == 1)]
    single_r = r_code[free_r & (r_count == 1)]
    both = single_s[isin(single_s, single_r)]
    rem_s = single_s[~isin(single_s, both)]
    rem_r = single_r[~isin(single_r, both)]
    ks, kr = _rank_in_group(rem_s // R), _rank_in_group(rem_r // R)
    big = max(int(ks.max(initial=0)), int(kr.max(initial=0))) + 1
    _, zs, zr = np.intersect1d((rem_s // R) * big + ks, (rem_r // R) * big + kr, assume_unique=True,
                               return_indices=True)
    zipped_s, zipped_r = rem_s[zs], rem_r[zr]
    only_s = s_code[free_s & ~isin(s_code, unique(np.concatenate((both, zipped_s))))]
    only_r = r_code[free_r & ~isin(r_code, unique(np.concatenate((both, zipped_r))))]
    none = np.full(len(only_s), -1)
    cands = [
        (t_key, 0, t_s, t_s, t_r),
        (both // R, 1, both % R, both % R, both % R),
        (zipped_s // R, 2, ks[zs], zipped_s % R, zipped_r % R),
        (only_s // R, 3, only_s % R, only_s % R, none),
        (only_r // R, 4, only_r % R, np.full(len(only_r), -1), only_r % R),
    ]
    lonely = unique(key[orphan])
    lonely = lonely[~isin(lonely, unique(np.concatenate([c[0] for c in cands])))]
    cands.append((lonely, 5, np.zeros(len(lonely), np.int64), np.full(len(lonely), -1), np.full(len(lonely), -1)))
    e_key = np.concatenate([c[0] for c in cands]).astype(np.int64)
    e_cat = np.concatenate([np.full(len(c[0]), c[1]) for c in cands])
    e_sub = np.concatenate([c[2] for c in cands]).astype(np.int64)
    e_send = np.concatenate([c[3] for c in cands]).astype(np.int64)
    e_recv = np.concatenate([c[4] for c in cands]).astype(np.int64)
    by = order_by(e_key * 6 + e_cat, e_sub)
    return e_key[by], e_send[by], e_recv[by]


def threadblocks(ins, dep_src: np.ndarray, dep_dst: np.ndarray, pos: np.ndarray) -> Placed:
    n = len(ins)
    R = int(max(ins.rank.max(), ins.send.max(), ins.recv.max())) + 1
    P = R + 1                                                     # peer codes: peer + 1 (0: none)
    nl = int(ins.lane.max()) + 1
    local = (ins.send < 0) & (ins.recv < 0)
    # local instructions: the thread block of the latest producer, else the first of their key
    best = _latest_producers(ins, dep_src, dep_dst, pos, local)
    orphan = local & (best == np.arange(n))
    ch = np.where(local, np.maximum(ins.ch, 0), ins.ch)
    nch = int(ch[~local | orphan].max()) + 1
    key = (ins.rank * nl + ins.lane) * nch + ch                   # (rank, lane, channel), in that order
    del ch
    e_key, e_send, e_recv = _candidates(ins, key, orphan, R, P)
    rows = np.arange(len(e_key))                                    # thread block rows, in (key, index) order
    tb = np.full(n, -1, dtype=np.int64)
    # a send peer (and a receive peer) has one thread block per key: look instructions up by (key, peer)
    space = (int(e_key.max(initial=0)) + 1) * P
    has_s, has_r = e_send >= 0, e_recv >= 0
    # receive-only instructions: the thread block with their receive peer; the others: the one with their
    # send peer (a tied pair's, for tied ones)
    recvs = ins.recv >= 0
    tb[recvs] = index_of(e_key[has_r] * P + e_recv[has_r], rows[has_r], key[recvs] * P + ins.recv[recvs], space)
    sends = ins.send >= 0
    del recvs
    tb[sends] = index_of(e_key[has_s] * P + e_send[has_s], rows[has_s], key[sends] * P + ins.send[sends], space)
    del sends
    o = np.flatnonzero(orphan)
    tb[o] = np.searchsorted(e_key, key[o])          # the first thread block of their key
    loc = np.flatnonzero(local & ~orphan)
    tb[loc] = tb[best[loc]]
    e_rank = e_key // (nl * nch)
    e_lane = (e_key // nch) % nl
    return Placed(tb=tb, tb_rank=e_rank, tb_send=e_send, tb_recv=e_recv, tb_chan=e_key % nch + e_lane * nch,
                  nchannels=nch)
