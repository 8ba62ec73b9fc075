"""Channels and thread blocks of compiled instructions (GC3 §5.2).

Channels: instructions linked by messages form a chain that must share one
channel; its channel is its directive if any, else the lowest channel on which
every instruction fits a thread block (at most one send peer, one receive peer
and one channel per thread block; one thread block per (peer, channel) and
direction on a GPU). Chains are placed in the order of their first instruction
in the global order. Physical channel = virtual channel + lane * (virtual
channels used).

Thread blocks, per (rank, lane, channel): pairs tied by instructions that both
receive and send, then single-message sends and receives to one peer paired,
then the other single-message sends and receives paired in peer order, then a
thread block per remaining send peer and per remaining receive peer. A
communicating instruction joins the thread block of its (send, receive) pair,
else the first with its send peer, else the first with its receive peer; a
local copy or reduction joins the thread block of its latest producer (in the
global order), else the first one of its (rank, lane, channel or 0).

Complexity, for N instructions and E dependencies: chains O(N log L) (pointer
jumping along messages, L the longest chain); channels, when every chain has a
directive, O(N log N) (the first instruction that contradicts an earlier
pairing is found with sorts); a program with chains without a directive is
placed chain by chain in Python, O(N) steps; thread blocks O(N log N) (sorts
and joins of (key, peer) codes); local instructions O(E + N log L).
"""
from __future__ import annotations

import numpy as np

from calibrate.errors import UserError
from kernels.gc3.arrays import order_by, unique
from kernels.gc3.table import STEP_TYPES
from kernels.gc3.threadblocks import Placed, threadblocks


def _established(code: np.ndarray, value: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Per element, the ``value`` of the first element (by ``rank``) of its ``code`` group."""
    by = order_by(code, rank)
    c = code[by]
    start = np.ones(len(c), dtype=bool)
    start[1:] = c[1:] != c[:-1]
    heads = np.flatnonzero(start)
    out = np.empty(len(code), dtype=value.dtype)
    out[by] = np.repeat(value[by][heads], np.diff(np.append(heads, len(c))))
    return out


def _chains(ins) -> np.ndarray:
    """Head of every instruction's message chain (itself if it receives nothing)."""
    head = np.where(ins.msg_from >= 0, ins.msg_from, np.arange(len(ins)))
    while True:
        nxt = head[head]
        if (nxt == head).all():
            return head
        head = nxt


def _misfit_message(ins, i: int, ch: int) -> str:
    return (f"rank {int(ins.rank[i])}: {STEP_TYPES[ins.type[i]].value} (send to {int(ins.send[i])}, receive from "
            f"{int(ins.recv[i])}) does not fit channel {ch}: a thread block there already pairs one of these peers "
            f"with another; give this chain another channel directive")


def _channels_directed(ins, proc: np.ndarray, ranks: int) -> None:
    """Every chain has a directive: check that no instruction contradicts an earlier pairing (in placement
    order ``proc``: rank of each instruction)."""
    tied = np.flatnonzero((ins.send >= 0) & (ins.recv >= 0))
    if not len(tied):
        return
    key = (ins.rank[tied] * (int(ins.lane.max()) + 1) + ins.lane[tied]) * (int(ins.ch.max()) + 1) + ins.ch[tied]
    s, r, p = ins.send[tied], ins.recv[tied], proc[tied]
    bad = (_established(key * ranks + s, r, p) != r) | (_established(key * ranks + r, s, p) != s)
    if bad.any():
        i = tied[np.flatnonzero(bad)[np.argmin(p[bad])]]
        raise UserError(_misfit_message(ins, int(i), int(ins.ch[i])))


def _channels_in_order(ins, members: list[list[int]], sm_count: int) -> None:
    """Chains (lists of instructions in placement order) placed one by one in Python."""
    pair_s: dict[tuple, int] = {}   # (rank, lane, ch, send peer) -> recv peer
    pair_r: dict[tuple, int] = {}
    rank, lane, send, recv, ch = (a.tolist() for a in (ins.rank, ins.lane, ins.send, ins.recv, ins.ch))
    for comm in members:
        directive = {ch[i] for i in comm if ch[i] >= 0}
        cands = list(directive) or range(sm_count + 1)
        bad = None
        for c in cands:
            new_s, new_r, bad = {}, {}, None
            for i in comm:
                if send[i] < 0 or recv[i] < 0:
                    continue
                ks, kr = (rank[i], lane[i], c, send[i]), (rank[i], lane[i], c, recv[i])
                if new_s.get(ks, pair_s.get(ks, recv[i])) != recv[i] or new_r.get(kr, pair_r.get(kr, send[i])) != send[i]:
                    bad = i
                    break
                new_s[ks], new_r[kr] = recv[i], send[i]
            if bad is None:
                pair_s.update(new_s)
                pair_r.update(new_r)
                for i in comm:
                    ch[i] = c
                break
        if bad is not None:
            raise UserError(_misfit_message(ins, bad, cands[0]))
    ins.ch[:] = ch


def _pairing_is_consistent(ins) -> bool:
    """Whether no two instructions of one (rank, lane, channel) tie a send peer (or a receive peer) to two
    different peers; O(N log N), whatever the placement order."""
    tied = np.flatnonzero((ins.send >= 0) & (ins.recv >= 0))
    if not len(tied):
        return True
    P = int(ins.rank.max()) + 1
    key = (ins.rank[tied] * (int(ins.lane.max()) + 1) + ins.lane[tied]) * (int(ins.ch.max()) + 1) + ins.ch[tied]
    pairs = unique((key * P + ins.send[tied]) * P + ins.recv[tied])
    by_send, by_recv = pairs // P, (pairs // (P * P)) * P + pairs % P
    return len(unique(by_send)) == len(pairs) == len(unique(by_recv))


def _place_channels(ins, pos: np.ndarray, sm_count: int) -> None:
    comm = np.flatnonzero((ins.send >= 0) | (ins.recv >= 0))
    if (ins.ch[comm] >= 0).all() and _pairing_is_consistent(ins):
        return   # every chain carries its directive (fusion joins only equal ones) and every chain fits
    head = _chains(ins)[comm]
    first = np.full(len(ins), len(ins), dtype=np.int64)
    np.minimum.at(first, head, pos[comm])
    by = order_by(first[head], pos[comm])     # placement order: chains by first position, then members
    comm, head = comm[by], head[by]
    proc = np.empty(len(ins), dtype=np.int64)
    proc[comm] = np.arange(len(comm))
    d = ins.ch[comm]
    lo = np.full(len(ins), np.iinfo(np.int64).max)
    hi = np.full(len(ins), -1)
    np.minimum.at(lo, head[d >= 0], d[d >= 0])
    np.maximum.at(hi, head[d >= 0], d[d >= 0])
    mixed = np.flatnonzero((hi[head] >= 0) & (lo[head] != hi[head]))
    if len(mixed):
        h = head[mixed[0]]
        dirs = sorted(set(ins.ch[comm[(head == h) & (d >= 0)]].tolist()))
        raise UserError(f"instructions chained by messages have different channel directives {dirs} (around rank "
                        f"{int(ins.rank[comm[np.flatnonzero(head == h)[0]]])}); give one chain one channel")
    if (hi[head] >= 0).all():
        ins.ch[comm] = hi[head]
        _channels_directed(ins, proc, int(ins.rank.max()) + 1)
        return
    starts = np.flatnonzero(np.concatenate(([True], head[1:] != head[:-1])))
    members = np.split(comm, starts[1:])
    _channels_in_order(ins, [m.tolist() for m in members], sm_count)


def place(ins, dep_src: np.ndarray, dep_dst: np.ndarray, order: np.ndarray, sm_count: int) -> Placed:
    """Channels (set in ``ins.ch``) and thread blocks of ``ins``."""
    n = len(ins)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    _place_channels(ins, pos, sm_count)
    return threadblocks(ins, dep_src, dep_dst, pos)
