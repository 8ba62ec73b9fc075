"""The compiler's global instruction order (GC3 §5.2): by dependency depth, then by decreasing reverse
depth, then by id; and the step order, which also makes every connection's receives follow its sends.

Depth is the longest path from a source over data dependencies and messages,
reverse depth the longest path to a sink. Both are computed by Kahn's algorithm
a level at a time on arrays: O(N + E) array work plus O(L) array calls for N
instructions, E edges and a longest path of L instructions (a level with more
than N / 16 successors is counted over all nodes at once, O(N), instead of
sorting its successors; at most 16 E / N levels are). The order is one
sort: O(N log N). The step order is that order when it already keeps every
connection's FIFO order (checked with one sort of the messages, O(M log M));
only otherwise a priority queue replays it in Python, O((N + E) log N).
"""
from __future__ import annotations

import heapq
from collections import defaultdict, deque

import numpy as np

from calibrate.errors import UserError
from kernels.gc3.arrays import bit_width, order_by


def levels(n: int, src: np.ndarray, dst: np.ndarray, fanout: np.ndarray, fanin: np.ndarray) -> np.ndarray:
    """Longest path (in edges) from a source to every node of the DAG ``src -> dst``; ``fanout`` and
    ``fanin`` are the nodes' out- and in-degrees (``fanin`` is used up). A level whose successors are
    more than n / 16 is counted densely (one count over all nodes, no sort; at most 16 E / n levels are
    that large, so O(N + E) in all)."""
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(fanout, out=ptr[1:])
    succ_of = dst[np.argsort(src, kind="stable")]   # edges come nearly sorted: timsort is fast
    indeg = fanin
    depth = np.zeros(n, dtype=np.int64)
    frontier = np.flatnonzero(indeg == 0)
    level = done = 0
    while len(frontier):
        depth[frontier] = level
        done += len(frontier)
        lo = ptr[frontier]
        cnt = ptr[frontier + 1] - lo
        if cnt.min() == 1 == cnt.max():
            succ = succ_of[lo]
        else:
            succ = succ_of[np.repeat(lo - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))]
        level += 1
        if 16 * len(succ) > n:
            hits = np.bincount(succ, minlength=n)
            indeg -= hits
            frontier = np.flatnonzero((indeg == 0) & (hits > 0))
            continue
        succ.sort()
        head = np.empty(len(succ), dtype=bool)
        head[:1] = True
        np.not_equal(succ[1:], succ[:-1], out=head[1:])
        if head.all():
            indeg[succ] -= 1
            frontier = succ[indeg[succ] == 0]
        else:
            starts = np.flatnonzero(head)
            nodes = succ[starts]
            indeg[nodes] -= np.diff(np.append(starts, len(succ)))
            frontier = nodes[indeg[nodes] == 0]
    if done < n:
        raise UserError("the instruction graph has a cycle; this is a compiler defect, please report it")
    return depth


def global_order(n: int, dep_src: np.ndarray, dep_dst: np.ndarray, msg_from: np.ndarray) -> np.ndarray:
    """Instruction ids sorted by (depth, -reverse depth, id). The degrees are counted once for both
    directions."""
    recv = np.flatnonzero(msg_from >= 0)
    src = np.concatenate((dep_src, msg_from[recv]))
    dst = np.concatenate((dep_dst, recv))
    fanout = np.bincount(src, minlength=n)
    fanin = np.bincount(dst, minlength=n)
    depth = levels(n, src, dst, fanout, fanin.copy())
    rdepth = levels(n, dst, src, fanin, fanout)
    del src, dst, fanout, fanin
    return order_by(depth, int(rdepth.max(initial=0)) - rdepth)   # stable: ids break ties


def step_order(order: np.ndarray, conn: np.ndarray, msg_from: np.ndarray, dep_src: np.ndarray,
               dep_dst: np.ndarray) -> np.ndarray:
    """``order`` if every connection (``conn`` of the sending instruction) receives in the order it sends,
    else the topological order closest to it that does."""
    n = len(order)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    recv = np.flatnonzero(msg_from >= 0)
    snd = msg_from[recv]
    c, ps = conn[snd], pos[snd]
    bits = bit_width(n)
    if not len(c) or (c.min() >= 0 and int(c.max()) < 1 << (62 - bits)):
        code = c << bits         # the send positions are distinct: one sort of (connection, position) codes
        code |= ps
        code.sort()
        c = code >> bits
        at = np.empty(n, dtype=np.int64)   # send position -> its receive's position
        at[ps] = pos[recv]
        r = at[code & ((1 << bits) - 1)]
        del code, at
    else:
        by = order_by(c, ps)
        c, r = c[by], pos[recv][by]
    if not ((c[1:] == c[:-1]) & (r[1:] < r[:-1])).any():
        return order
    return _heap_order(order, pos, conn, msg_from, dep_src, dep_dst)


def _heap_order(order, pos, conn, msg_from, dep_src, dep_dst) -> np.ndarray:
    n = len(order)
    rank_of = pos.tolist()
    msg = msg_from.tolist()
    conn_l = conn.tolist()
    recv = np.flatnonzero(msg_from >= 0)
    src = np.concatenate((dep_src, msg_from[recv])).tolist()
    dst = np.concatenate((dep_dst, recv)).tolist()
    succ = defaultdict(list)
    preds: dict[int, set] = defaultdict(set)
    for a, b in zip(src, dst):
        if a not in preds[b]:
            preds[b].add(a)
            succ[a].append(b)
    missing = [len(preds[i]) for i in range(n)]
    sends = set(msg_from[recv].tolist())
    heap = [(rank_of[i], i) for i in range(n) if missing[i] == 0]
    heapq.heapify(heap)
    queues: dict[int, deque] = defaultdict(deque)   # sends whose receive is not scheduled yet
    parked: dict[int, dict[int, int]] = defaultdict(dict)   # conn -> send id -> its parked receive
    result = []
    while heap:
        _, i = heapq.heappop(heap)
        if msg[i] >= 0:
            c = conn_l[msg[i]]
            if queues[c][0] != msg[i]:
                parked[c][msg[i]] = i
                continue
            queues[c].popleft()
            if queues[c] and queues[c][0] in parked[c]:
                q = parked[c].pop(queues[c][0])
                heapq.heappush(heap, (rank_of[q], q))
        if i in sends:
            queues[conn_l[i]].append(i)
        result.append(i)
        for s in succ[i]:
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(heap, (rank_of[s], s))
    if len(result) != n:
        raise UserError("cannot order the receives of a connection like its sends (a cycle through a FIFO); "
                        "put the crossing transfers on different channels")
    return np.array(result, dtype=np.int64)
