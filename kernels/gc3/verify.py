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
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from calibrate.errors import UserError
from kernels.gc3.executor import step_name
from kernels.gc3.ir import Program

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
            for i, st in enumerate(tb.steps):
                if st.type.sends:
                    sends[(g.id, tb.send, tb.chan)].append((g.id, tb, i))
                if st.type.receives:
                    recvs[(tb.recv, g.id, tb.chan)].append((g.id, tb, i))
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


def _check_deadlock(program: Program, sends, recvs, fifo_slots: int) -> None:
    # node: (rank, tb id, step, phase); phase 1 exists only for steps that receive and send
    edges: dict[tuple, list[tuple[tuple, str]]] = defaultdict(list)
    nodes = []
    steps = {}

    def first(r, t, i):
        return (r, t, i, 0)

    def last(r, t, i):
        st = steps[(r, t, i)]
        return (r, t, i, 1 if st.type.sends and st.type.receives else 0)

    for g in program.gpus:
        for tb in g.threadblocks:
            for i, st in enumerate(tb.steps):
                steps[(g.id, tb.id, i)] = st
    for (r, t, i), st in steps.items():
        nodes.append(first(r, t, i))
        if last(r, t, i) != first(r, t, i):
            nodes.append(last(r, t, i))
            edges[first(r, t, i)].append((last(r, t, i), "thread-block order"))
        if i > 0:
            edges[last(r, t, i - 1)].append((first(r, t, i), "thread-block order"))
        for d in st.deps:
            edges[last(r, *d)].append((first(r, t, i), "dependency"))
    for key, s in sends.items():
        rv = recvs.get(key, [])
        for k, (a, b) in enumerate(zip(s, rv)):
            edges[last(a[0], a[1].id, a[2])].append((first(b[0], b[1].id, b[2]), "send/receive order on a connection"))
        for k in range(len(rv)):
            if k + fifo_slots < len(s):
                a, b = rv[k], s[k + fifo_slots]
                edges[first(a[0], a[1].id, a[2])].append((last(b[0], b[1].id, b[2]), "FIFO slots"))
    indeg = defaultdict(int)
    for u in nodes:
        for v, _ in edges[u]:
            indeg[v] += 1
    ready = [u for u in nodes if indeg[u] == 0]
    seen = 0
    while ready:
        u = ready.pop()
        seen += 1
        for v, _ in edges[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    if seen == len(nodes):
        return
    stuck = {u for u in nodes if indeg[u] > 0}
    cycle = _find_cycle(stuck, edges)
    parts = []
    for (u, kind) in cycle:
        st = steps[u[:3]]
        parts.append(f"{step_name(u[0], u[1], u[2], st)}{' send' if u[3] else ''} -[{kind}]->")
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
