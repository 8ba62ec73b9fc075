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

Complexity, for S steps, D dependencies and M messages: connections O(S),
message matching O(M), hasdep O(S + D), deadlock O(S + D + M): the wait-for
graph has integer nodes and is acyclic exactly when each of its strongly
connected components (scipy's, in C) is one node without a self-loop; only a
cyclic graph is walked in Python, within one component, to name the cycle.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from calibrate.errors import UserError
from kernels.gc3.executor import step_name
from kernels.gc3.ir import RECEIVING, SENDING, Program

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


def _connections(program: Program):
    """(sender, receiver, channel) -> list of (rank, tb, step) of its sends, and of its receives."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for g in program.gpus:
        seen_send, seen_recv = {}, {}
        for tb in g.threadblocks:
            for peer, seen, what in ((tb.send, seen_send, "send to"), (tb.recv, seen_recv, "receive from")):
                if peer < 0:
                    continue
                key = (peer, tb.chan)
                if key in seen:
                    raise VerifyError("connection conflict", f"gpu {g.id}: thread blocks {seen[key]} and {tb.id} "
                                      f"both {what} gpu {peer} on channel {tb.chan}; give them different channels")
                seen[key] = tb.id
            out, inc = (g.id, tb.send, tb.chan), (tb.recv, g.id, tb.chan)
            for i, st in enumerate(tb.steps):
                t = st.type
                if t in SENDING:
                    sends[out].append((g.id, tb, i))
                if t in RECEIVING:
                    recvs[inc].append((g.id, tb, i))
    return sends, recvs


def verify(program: Program, sm_count: int = DEFAULT_SM_COUNT, fifo_slots: int = 1) -> Summary:
    """Check ``program``; raise ``VerifyError`` naming the place of the first defect found."""
    if len(program.gpus) != program.ngpus:
        raise VerifyError("bad program", f"{len(program.gpus)} GPUs listed but ngpus={program.ngpus}")
    for g in program.gpus:
        if len(g.threadblocks) > sm_count:
            raise VerifyError("too many thread blocks", f"gpu {g.id} uses {len(g.threadblocks)} thread blocks but "
                              f"the target GPU has {sm_count} SMs; use fewer channels or instances")
    sends, recvs = _connections(program)
    for key in sorted(set(sends) | set(recvs)):
        s, r = sends.get(key, []), recvs.get(key, [])
        for k, (a, b) in enumerate(zip(s, r)):
            sa, sb = a[1].steps[a[2]], b[1].steps[b[2]]
            if sa.cnt != sb.cnt:
                raise VerifyError("message mismatch", f"{step_name(a[0], a[1].id, a[2], sa)} sends {sa.cnt} chunks "
                                  f"but its matching receive {step_name(b[0], b[1].id, b[2], sb)} takes {sb.cnt}")
        if len(s) != len(r):
            extra = s[len(r)] if len(s) > len(r) else r[len(s)]
            st = extra[1].steps[extra[2]]
            raise VerifyError("unmatched message", f"connection gpu {key[0]} -> gpu {key[1]} channel {key[2]} has "
                              f"{len(s)} sends and {len(r)} receives; {step_name(extra[0], extra[1].id, extra[2], st)} "
                              f"has no partner")
    waited = set()
    for g in program.gpus:
        for tb in g.threadblocks:
            for i, st in enumerate(tb.steps):
                for d in st.deps:
                    waited.add((g.id, *d))
    for g in program.gpus:
        for tb in g.threadblocks:
            for i, st in enumerate(tb.steps):
                if (g.id, tb.id, i) in waited and not st.has_dep:
                    raise VerifyError("missing hasdep", f"{step_name(g.id, tb.id, i, st)} is waited on by another "
                                      f"thread block but has hasdep=0, so it would never signal")
    _check_deadlock(program, sends, recvs, fifo_slots)
    return Summary(
        ngpus=program.ngpus,
        threadblocks=program.max_threadblocks,
        total_threadblocks=sum(len(g.threadblocks) for g in program.gpus),
        channels=len({tb.chan for g in program.gpus for tb in g.threadblocks}),
        steps=sum(len(tb.steps) for g in program.gpus for tb in g.threadblocks),
        connections=len(sends),
    )


_KINDS = ("thread-block order", "dependency", "send/receive order on a connection", "FIFO slots")


def _check_deadlock(program: Program, sends, recvs, fifo_slots: int) -> None:
    # node ids: step k of thread block t of gpu r is base[(r, t)] + k (its first phase); a step that
    # receives and sends has a second (send) phase, numbered from S on
    base: dict[tuple[int, int], int] = {}
    both, starts, where = [], [], []
    n = 0
    for g in program.gpus:
        for tb in g.threadblocks:
            base[(g.id, tb.id)] = n
            if tb.steps:
                starts.append(n)
            where.append((n, g.id, tb))
            n += len(tb.steps)
            both.extend(st.type in SENDING and st.type in RECEIVING for st in tb.steps)
    two = np.flatnonzero(np.fromiter(both, dtype=bool, count=n))
    last = np.arange(n, dtype=np.int64)
    last[two] = n + np.arange(len(two))
    total = n + len(two)
    follows = np.ones(n, dtype=bool)
    follows[starts] = False
    nxt = np.flatnonzero(follows)
    src = [two, last[nxt - 1]]
    dst = [last[two], nxt]
    kinds = [np.zeros(len(two) + len(nxt), dtype=np.int8)]
    dep_src, dep_dst = [], []
    for g in program.gpus:
        for tb in g.threadblocks:
            b = base[(g.id, tb.id)]
            for i, st in enumerate(tb.steps):
                for d in st.deps:
                    dep_src.append(base[(g.id, d[0])] + d[1])
                    dep_dst.append(b + i)
    src.append(last[np.asarray(dep_src, dtype=np.int64)])
    dst.append(np.asarray(dep_dst, dtype=np.int64))
    kinds.append(np.full(len(dep_src), 1, dtype=np.int8))
    m_src, m_dst, f_src, f_dst = [], [], [], []
    for key, s in sends.items():
        rv = recvs.get(key, [])
        sg = [base[(a[0], a[1].id)] + a[2] for a in s]
        rg = [base[(a[0], a[1].id)] + a[2] for a in rv]
        m_src += sg[:len(rg)]
        m_dst += rg[:len(sg)]
        f_src += rg[:max(0, len(sg) - fifo_slots)]
        f_dst += sg[fifo_slots:fifo_slots + len(rg)]
    src.append(last[np.asarray(m_src, dtype=np.int64)])
    dst.append(np.asarray(m_dst, dtype=np.int64))
    kinds.append(np.full(len(m_src), 2, dtype=np.int8))
    src.append(np.asarray(f_src, dtype=np.int64))
    dst.append(last[np.asarray(f_dst, dtype=np.int64)])
    kinds.append(np.full(len(f_src), 3, dtype=np.int8))
    src, dst, kinds = np.concatenate(src), np.concatenate(dst), np.concatenate(kinds)
    graph = csr_matrix((np.ones(len(src), dtype=np.int8), (src, dst)), shape=(total, total))
    ncomp, labels = connected_components(graph, directed=True, connection="strong")
    loops = src == dst
    if ncomp == total and not loops.any():
        return
    sizes = np.bincount(labels, minlength=ncomp)
    cyclic = np.flatnonzero((sizes[labels] > 1) | np.isin(np.arange(total), src[loops]))
    comp = labels[cyclic.min()]
    inside = labels == comp
    keep = inside[src] & inside[dst]
    edges: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for u, v, k in zip(src[keep].tolist(), dst[keep].tolist(), kinds[keep].tolist()):
        edges[u].append((v, _KINDS[k]))
    cycle = _find_cycle(set(np.flatnonzero(inside).tolist()), edges)
    starts_arr = np.asarray([w[0] for w in where], dtype=np.int64)
    parts = []
    for (u, kind) in cycle:
        phase = u >= n
        gid = int(two[u - n]) if phase else u
        t = int(np.searchsorted(starts_arr, gid, side="right")) - 1
        while where[t][0] > gid or len(where[t][2].steps) <= gid - where[t][0]:
            t -= 1
        b, rank, tb = where[t]
        i = gid - b
        parts.append(f"{step_name(rank, tb.id, i, tb.steps[i])}{' send' if phase else ''} -[{kind}]->")
    raise VerifyError("deadlock", "cycle " + " ".join(parts) + " back to the first; reorder the steps, "
                      "use separate channels or more FIFO slots")


def _find_cycle(stuck: set, edges) -> list[tuple[tuple, str]]:
    """A cycle within ``stuck`` as (node, label of its outgoing edge) pairs."""
    start = min(stuck)
    # every stuck node has a stuck predecessor; walk predecessors until a node repeats
    preds: dict[tuple, tuple[tuple, str]] = {}
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
