"""Static checks of an IR: connections, dependencies, resources and deadlock freedom.

A deadlock is a cycle in the wait-for graph whose nodes are step phases (a step
that receives and sends has a receive phase, then a send phase) and whose edges
are labelled with why one waits for the other:
- "thread-block order": a thread block runs its steps in order;
- "dependency": a step waits for the steps in its ``deps``;
- "send/receive order on a connection": the k-th receive on a connection
  (sender, receiver, channel) waits for the k-th send;
- "FIFO slots": the (k+slots)-th send waits for the k-th receive to free a slot.
Thread blocks are deterministic processes connected by FIFOs, so a cycle here is
exactly a reachable deadlock, whatever the interleaving.

Every check works on the columnar IR (``kernels.gc3.table.IRTable``; a
``Program`` is converted first, O(S + D)) with array operations. Complexity,
for S steps, T thread blocks, D dependencies and M messages: the SM count
O(T); connection conflicts O(T log T) (one sort); message matching
O(M log M) (one sort of the sends' and one of the receives' codes, keyed per
thread block); hasdep O(S + D); deadlock O(S + D + M) to build the reverse
wait-for graph straight into compressed rows (no sort of its edges), O(E log d)
to sort each node's row (d: the most edges of a node) plus its strongly
connected components (scipy's, in C): the graph is acyclic exactly when each
component is one node without a self-loop; only a cyclic graph is rebuilt and
walked in Python, within one component, to name the cycle. Memory O(S + D + M).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from calibrate.errors import UserError
from kernels.gc3.arrays import isin, order_by, rank_in_group, run_counts, unique
from kernels.gc3.ir import Program
from kernels.gc3.table import RECEIVES, SENDS, IRTable

DEFAULT_SM_COUNT = 132  # H100 SXM and H200: 132 streaming multiprocessors


class VerifyError(UserError):
    """The program is invalid; ``kind`` names the class of defect."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass
class Summary:
    ngpus: int
    threadblocks: int          # most thread blocks on one GPU
    total_threadblocks: int
    channels: int
    steps: int
    connections: int


@dataclass
class _Messages:
    """Sending and receiving steps of every connection (sender GPU, receiver GPU, channel), each sorted by
    connection then by program order; ``k`` is a step's position on its connection."""

    send_key: np.ndarray
    send_step: np.ndarray
    send_k: np.ndarray
    recv_key: np.ndarray
    recv_step: np.ndarray
    recv_k: np.ndarray


def _check_connections(t: IRTable) -> None:
    """No two thread blocks of a GPU send to (or receive from) one peer on one channel."""
    ntb = len(t.tb_gpu)
    peer = np.concatenate((t.tb_send, t.tb_recv))
    row = np.concatenate((np.arange(ntb), np.arange(ntb)))
    direction = np.repeat([0, 1], ntb)
    order = 2 * row + direction
    keep = peer >= 0
    peer, row, direction, order = peer[keep], row[keep], direction[keep], order[keep]
    chan = t.tb_chan[row]
    gpu = t.tb_gpu[row]
    code = ((gpu * 2 + direction) * (int(peer.max(initial=0)) + 1) + peer) * (int(chan.max(initial=0)) + 1) + chan
    by = order_by(code, order)
    same = np.zeros(len(by), dtype=bool)
    if len(by) > 1:
        a, b = by[1:], by[:-1]
        same[1:] = (gpu[a] == gpu[b]) & (direction[a] == direction[b]) & (peer[a] == peer[b]) & (chan[a] == chan[b])
    if not same.any():
        return
    dup = np.flatnonzero(same)
    first_dup = dup[np.argmin(order[by[dup]])]
    start = first_dup
    while same[start]:
        start -= 1
    e, seen = by[first_dup], by[start]
    what = "send to" if direction[e] == 0 else "receive from"
    raise VerifyError("connection conflict", f"gpu {int(t.gpu_id[gpu[e]])}: thread blocks {int(t.tb_id[row[seen]])} "
                      f"and {int(t.tb_id[row[e]])} both {what} gpu {int(peer[e])} on channel {int(chan[e])}; "
                      f"give them different channels")


def _messages(t: IRTable) -> _Messages:
    step_tb = t.step_tb()
    gid = t.gpu_id[t.tb_gpu]
    ng = max(int(t.ngpus), int(t.gpu_id.max(initial=0)) + 1)
    nch = int(t.tb_chan.max(initial=0)) + 1

    def side(mask, sender, receiver):
        """A thread block's connection is its (sender, receiver, channel): keyed per thread block."""
        steps = np.flatnonzero(mask)
        key = ((sender * ng + receiver) * nch + t.tb_chan)[step_tb[steps]]
        # stable: steps are in program order within a connection
        order = order_by(key) if key.min(initial=0) >= 0 else np.argsort(key, kind="stable")
        key, steps = key[order], steps[order]
        return key, steps, rank_in_group(key)
    sk, ss, sn = side(SENDS[t.st_type], gid, t.tb_send)
    rk, rs, rn = side(RECEIVES[t.st_type], t.tb_recv, gid)
    return _Messages(sk, ss, sn, rk, rs, rn)


def _meet(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indexes (i, j) with a[i] == b[j], for sorted arrays of distinct codes; O(len(a) log len(b))."""
    if not len(b):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    j = np.minimum(np.searchsorted(b, a), len(b) - 1)
    i = np.flatnonzero(b[j] == a)
    return i, j[i]


def _codes(m: _Messages, fifo_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(connection, position) codes of the sends and of the receives, sorted, with room for ``fifo_slots``."""
    big = int(max(m.send_k.max(initial=0), m.recv_k.max(initial=0))) + fifo_slots + 1
    return m.send_key * big + m.send_k, m.recv_key * big + m.recv_k


def _check_messages(t: IRTable, m: _Messages, ia: np.ndarray, ib: np.ndarray, ng: int, nch: int) -> None:
    """``ia``, ``ib``: the matched messages (the k-th send and k-th receive of a connection), as positions in
    ``m``'s sends and receives."""
    snd, rcv = m.send_step[ia], m.recv_step[ib]
    bad_cnt = t.st_cnt[snd] != t.st_cnt[rcv]
    keys, s_counts = run_counts(m.send_key)
    rkeys, r_counts = run_counts(m.recv_key)
    if np.array_equal(keys, rkeys):       # every connection both sends and receives
        allkeys, ns, nr = keys, s_counts, r_counts
    else:
        allkeys = unique(np.concatenate((keys, rkeys)))
        ns = np.zeros(len(allkeys), dtype=np.int64)
        nr = np.zeros(len(allkeys), dtype=np.int64)
        ns[np.searchsorted(allkeys, keys)] = s_counts
        nr[np.searchsorted(allkeys, rkeys)] = r_counts
    unmatched = ns != nr
    # the first connection (in key order) with a defect is reported
    pair_key = m.send_key[ia]
    mism_keys = pair_key[bad_cnt]
    first_mism = mism_keys.min() if len(mism_keys) else None
    first_unm = allkeys[unmatched].min() if unmatched.any() else None
    if first_mism is None and first_unm is None:
        return
    if first_mism is not None and (first_unm is None or first_mism <= first_unm):
        k = np.flatnonzero(bad_cnt & (pair_key == first_mism))
        k = k[np.argmin(snd[k])]
        a, b = int(snd[k]), int(rcv[k])
        raise VerifyError("message mismatch", f"{t.step_name(a)} sends {int(t.st_cnt[a])} chunks but its matching "
                          f"receive {t.step_name(b)} takes {int(t.st_cnt[b])}")
    key = int(first_unm)
    j = int(np.searchsorted(allkeys, key))
    nsend, nrecv = int(ns[j]), int(nr[j])
    if nsend > nrecv:
        extra = m.send_step[np.flatnonzero((m.send_key == key) & (m.send_k == nrecv))[0]]
    else:
        extra = m.recv_step[np.flatnonzero((m.recv_key == key) & (m.recv_k == nsend))[0]]
    sender, rest = divmod(key, ng * nch)
    receiver, chan = divmod(rest, nch)
    raise VerifyError("unmatched message", f"connection gpu {sender} -> gpu {receiver} channel {chan} has "
                      f"{nsend} sends and {nrecv} receives; {t.step_name(int(extra))} has no partner")


def _dep_rows(t: IRTable) -> tuple[np.ndarray, np.ndarray]:
    """(waiting step row, awaited step row) of every dependency."""
    step_tb = t.step_tb()
    waiter = np.repeat(np.arange(t.steps), np.diff(t.dep_start))
    tb = t.tb_row(t.tb_gpu[step_tb[waiter]], t.dep_tb)
    if (tb < 0).any() or (t.dep_step >= np.diff(t.tb_start)[tb]).any():
        k = int(waiter[np.flatnonzero((tb < 0) | (t.dep_step >= np.diff(t.tb_start)[tb]))[0]])
        raise VerifyError("bad dependency", f"{t.step_name(k)} depends on a step that does not exist")
    return waiter, t.tb_start[tb] + t.dep_step


def verify(program: Program | IRTable, sm_count: int = DEFAULT_SM_COUNT, fifo_slots: int = 1) -> Summary:
    """Check ``program``; raise ``VerifyError`` naming the place of the first defect found."""
    t = program if isinstance(program, IRTable) else IRTable.from_program(program)
    if len(t.gpu_id) != t.ngpus:
        raise VerifyError("bad program", f"{len(t.gpu_id)} GPUs listed but ngpus={t.ngpus}")
    per_gpu = np.bincount(t.tb_gpu, minlength=len(t.gpu_id))
    over = np.flatnonzero(per_gpu > sm_count)
    if len(over):
        g = over[0]
        raise VerifyError("too many thread blocks", f"gpu {int(t.gpu_id[g])} uses {int(per_gpu[g])} thread blocks "
                          f"but the target GPU has {sm_count} SMs; use fewer channels or instances")
    _check_connections(t)
    m = _messages(t)
    ng = max(int(t.ngpus), int(t.gpu_id.max(initial=0)) + 1)
    nch = int(t.tb_chan.max(initial=0)) + 1
    a, b = _codes(m, fifo_slots)
    ia, ib = _meet(a, b)
    _check_messages(t, m, ia, ib, ng, nch)
    waiter, awaited = _dep_rows(t)
    missing = np.zeros(t.steps, dtype=bool)
    missing[awaited] = True
    missing &= ~t.st_hasdep
    if missing.any():
        k = int(np.flatnonzero(missing)[0])
        raise VerifyError("missing hasdep", f"{t.step_name(k)} is waited on by another thread block but has "
                          f"hasdep=0, so it would never signal")
    _check_deadlock(t, m, (a, b, ia, ib), waiter, awaited, fifo_slots)
    return Summary(
        ngpus=t.ngpus,
        threadblocks=t.max_threadblocks,
        total_threadblocks=len(t.tb_gpu),
        channels=len(unique(t.tb_chan)),
        steps=t.steps,
        connections=int(len(m.send_key) > 0) + int(np.count_nonzero(np.diff(m.send_key))),   # sorted keys
    )


_KINDS = ("thread-block order", "dependency", "send/receive order on a connection", "FIFO slots")


def _check_deadlock(t: IRTable, m: _Messages, matched: tuple, waiter: np.ndarray, awaited: np.ndarray,
                    fifo_slots: int) -> None:
    """Raise if the wait-for graph has a cycle. The graph is built as the rows of its reverse (each node's
    list of the nodes it waits for), straight into compressed-row arrays: every node has at most one
    thread-block-order, message and FIFO edge and its dependencies are already grouped by waiting step,
    so each kind of edge is one scatter at known offsets, O(S + D + M), no sort. A graph and its reverse
    have the same strongly connected components."""
    # node k < S: step row k (its first phase); a step that receives and sends has a second (send)
    # phase, numbered from S on
    n = t.steps
    two = np.flatnonzero(SENDS[t.st_type] & RECEIVES[t.st_type])
    total = n + len(two)
    if len(two):
        last = np.arange(n, dtype=np.int64)
        last[two] = n + np.arange(len(two))
    else:
        last = None                         # every step is one node: last phase of k is k

    def phase(k):
        return k if last is None else last[k]
    a, b, ia, ib = matched      # send and receive codes (``_codes``), and the matched pairs
    # FIFO: the k-th receive frees the slot the (k + slots)-th send needs
    fa, fb = _meet(a - fifo_slots, b)
    nxt = _following(t)
    # (waiting node, awaited node) per kind, each waiting node at most once except for dependencies
    single = ((nxt, phase(nxt - 1)), (n + np.arange(len(two)), two), (m.recv_step[ib], phase(m.send_step[ia])),
              (phase(m.send_step[fa]), m.recv_step[fb]))
    ndeps = np.diff(t.dep_start)
    on_deps = phase(awaited)
    if (on_deps == waiter).any() or any(w.size and (w == u).any() for w, u in single):
        _report_deadlock(t, two, m, (ia, ib, fa, fb), waiter, awaited)
    idx = np.int32 if total + len(waiter) + sum(len(w) for w, _ in single) < 2 ** 31 else np.int64
    degree = np.zeros(total, dtype=idx)
    degree[:n] = ndeps
    for w, _ in single:
        degree[w] += 1
    indptr = np.zeros(total + 1, dtype=idx)
    np.cumsum(degree, out=indptr[1:])
    del degree
    indices = np.empty(int(indptr[-1]), dtype=idx)
    fill = indptr[:-1].copy()               # next free place in each node's row
    indices[np.arange(len(waiter), dtype=idx) + np.repeat(fill[:n] - t.dep_start[:-1].astype(idx), ndeps)] = on_deps
    fill[:n] += ndeps.astype(idx)
    del on_deps
    for w, u in single:
        indices[fill[w]] = u
        fill[w] += 1
    del fill, single
    ncomp, _ = connected_components(_canonical(indices, indptr, total), directed=True, connection="strong")
    if ncomp != total:
        _report_deadlock(t, two, m, (ia, ib, fa, fb), waiter, awaited)


def _canonical(indices: np.ndarray, indptr: np.ndarray, total: int) -> csr_matrix:
    """The graph as a compressed-row matrix with sorted rows and no repeated edge (scipy 1.17's strong
    components never return on some graphs with a repeated edge, e.g. rows [[1, 1], []])."""
    graph = csr_matrix((np.ones(len(indices)), indices, indptr), shape=(total, total), copy=False)
    graph.sum_duplicates()
    return graph


def _following(t: IRTable) -> np.ndarray:
    """The steps that follow another step of their thread block."""
    follows = np.ones(t.steps, dtype=bool)
    follows[t.tb_start[:-1][np.diff(t.tb_start) > 0]] = False
    return np.flatnonzero(follows)


def _report_deadlock(t: IRTable, two: np.ndarray, m: _Messages, pairs: tuple, waiter: np.ndarray,
                     awaited: np.ndarray) -> None:
    """Name a cycle of the (cyclic) wait-for graph: the one through the lowest node on a cycle, found within
    its strongly connected component."""
    n = t.steps
    total = n + len(two)
    last = np.arange(n, dtype=np.int64)
    last[two] = n + np.arange(len(two))
    ia, ib, fa, fb = pairs
    nxt = _following(t)
    src = np.concatenate((two, last[nxt - 1], last[awaited], last[m.send_step[ia]], m.recv_step[fb]))
    dst = np.concatenate((last[two], nxt, waiter, m.recv_step[ib], last[m.send_step[fa]]))
    by = order_by(src)
    indptr = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=total), out=indptr[1:])
    ncomp, labels = connected_components(_canonical(dst[by], indptr, total), directed=True, connection="strong")
    loops = src == dst
    sizes = np.bincount(labels, minlength=ncomp)
    kinds = np.concatenate((np.zeros(len(two) + len(nxt), dtype=np.int8), np.full(len(waiter), 1, np.int8),
                            np.full(len(ia), 2, np.int8), np.full(len(fa), 3, np.int8)))
    cyclic = np.flatnonzero((sizes[labels] > 1) | isin(np.arange(total), unique(src[loops])))
    comp = labels[cyclic.min()]
    inside = labels == comp
    keep = inside[src] & inside[dst]
    edges: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for u, v, k in zip(src[keep].tolist(), dst[keep].tolist(), kinds[keep].tolist()):
        edges[u].append((v, _KINDS[k]))
    cycle = _find_cycle(set(np.flatnonzero(inside).tolist()), edges)
    parts = []
    for u, kind in cycle:
        phase = u >= n
        parts.append(f"{t.step_name(int(two[u - n]) if phase else u)}{' send' if phase else ''} -[{kind}]->")
    raise VerifyError("deadlock", "cycle " + " ".join(parts) + " back to the first; reorder the steps, "
                      "use separate channels or more FIFO slots")


def _find_cycle(stuck: set, edges) -> list[tuple[int, str]]:
    """A cycle within ``stuck`` as (node, label of its outgoing edge) pairs."""
    start = min(stuck)
    # every stuck node has a stuck predecessor; walk predecessors until a node repeats
    preds: dict[int, tuple[int, str]] = {}
    for u in stuck:
        for v, kind in edges[u]:
            if v in stuck and v not in preds:
                preds[v] = (u, kind)
    order, pos, u = [], {}, start
    while u not in pos:
        pos[u] = len(order)
        order.append(u)
        u = preds[u][0]
    loop = order[pos[u]:]
    loop.reverse()  # now each node's successor follows it
    return [(n, preds[loop[(k + 1) % len(loop)]][1]) for k, n in enumerate(loop)]
