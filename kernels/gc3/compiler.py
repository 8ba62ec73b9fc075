"""GC3 compiler (GC3 §4 and §5): traced ops -> instruction DAG -> fused, scheduled IR.

1. Replication: every op is split over the ``parallelize(n)`` replicas it was
   traced in (replica j moves chunks [j*c/n, (j+1)*c/n) of its c chunks) and
   over program-wide ``instances`` (logical chunk i becomes chunk i*instances+k
   for instance k, which keeps every collective's chunk-to-rank layout; with
   several instances an op is split into one op per chunk). Each (instance,
   replica) is a *lane*; lanes get disjoint channels.
2. Lowering: a copy or reduce within a rank is ``cpy`` or ``re``; across ranks it
   is a ``s`` on the source rank and a ``r`` (copy) or ``rrc`` (reduce) on the
   destination. Data dependencies (read after write, write after read, write
   after write) per chunk slot give the instruction DAG.
3. Fusion (§4.2): a send whose only input is what a ``r``/``rrc`` just wrote is
   folded into it: ``rcs``/``rrcs``; an ``rrcs`` whose written value is dead (the
   next access of those slots is a plain write, or none and the slots are not
   the collective's output) becomes ``rrs``.
4. Channels and thread blocks (``kernels.gc3.placement``), 5. order and
   cross-thread-block dependencies (``kernels.gc3.emit``).
The result, an ``IRTable``, is checked by ``kernels.gc3.verify`` (deadlock, SM count).

Every pass works on columns (one numpy row per op, instruction, chunk access or
dependency), never on a Python object per instruction. Complexity, for n traced
ops, N instructions, A chunk accesses (the chunks the instructions read or
write, so A = O(N * chunks per op)) and D dependencies (D <= 2A): replication
O(n * instances + A); lowering O(N); dependencies O(A log A) (one sort of the
accesses by slot, then running maxima); fusion O(N + D log D) (candidates are
sends with one dependency, matched by array comparisons; only a program that
mixes channel directives with ops without one and uses several directives
takes O(N) Python steps, to replay the order-dependent choices); dead writes
O(A) on the same sorted accesses. Memory O(A + D).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from calibrate.errors import UserError
from kernels.gc3.arrays import bit_width, order_by, unique
from kernels.gc3.algorithms import build
from kernels.gc3.dsl import GC3Program
from kernels.gc3.emit import emit
from kernels.gc3.ir import Program, Protocol
from kernels.gc3.oplog import COPY
from kernels.gc3.order import global_order, step_order
from kernels.gc3.placement import place
from kernels.gc3.table import IRTable
from kernels.gc3.verify import DEFAULT_SM_COUNT, verify

# step type codes (indexes into kernels.gc3.table.STEP_TYPES)
SEND, RECV, RCS, RRS, RRC, RRCS, CPY, RE = range(8)


@dataclass
class Instrs:
    """Instructions in columns; ids are row numbers, in trace order (a topological order)."""

    rank: np.ndarray
    type: np.ndarray
    src_buf: np.ndarray
    src_idx: np.ndarray
    dst_buf: np.ndarray
    dst_idx: np.ndarray
    cnt: np.ndarray
    lane: np.ndarray
    ch: np.ndarray           # channel directive (-1: none); the placed channel once placed
    send: np.ndarray         # peer, -1 for none
    recv: np.ndarray
    msg_from: np.ndarray     # the instruction whose message this one receives, -1 for none
    msg_to: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)

    def take(self, rows: np.ndarray) -> "Instrs":
        """The instructions ``rows`` (sorted), renumbered 0..len-1 (message links follow)."""
        new = np.full(len(self), -1, dtype=np.int64)
        new[rows] = np.arange(len(rows))
        cols = {k: getattr(self, k)[rows] for k in self.__dataclass_fields__}
        for k in ("msg_from", "msg_to"):
            v = cols[k]
            cols[k] = np.where(v >= 0, new[np.maximum(v, 0)], -1)
        return Instrs(**cols)


def _replicate(prog: GC3Program):
    """Physical ops (kind, src rank/buf/idx, dst rank/buf/idx, count, lane, ch) and the lane count."""
    ops, n = prog.ops, prog.instances
    bad = np.flatnonzero(ops.count % ops.parallel)
    if len(bad):
        k = int(bad[0])
        raise UserError(f"op #{k} moves {int(ops.count[k])} chunks, not divisible by "
                        f"parallelize({int(ops.parallel[k])})")
    cols = (ops.kind, ops.src_rank, ops.src_buf, ops.src_idx, ops.dst_rank, ops.dst_buf, ops.dst_idx,
            ops.count, ops.ch, ops.parallel, ops.scope)
    if n == 1 and (ops.parallel == 1).all():
        return cols[:8] + (np.zeros(len(ops), dtype=np.int64), ops.ch), 1
    if n == 1:   # replica j of an op moves chunks [j * part, (j + 1) * part)
        reps = ops.parallel
        off = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
        part = ops.count // ops.parallel
        expand = [np.repeat(c, reps) for c in cols]
        j = off
        count = np.repeat(part, reps)
        base = j * count
        k = np.zeros(len(j), dtype=np.int64)
    else:        # one op per chunk and instance: instance-major, then op, then chunk
        cnt = ops.count
        per = np.repeat(np.arange(len(ops)), cnt)
        off1 = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        expand = [np.tile(c[per], n) for c in cols]
        base = np.tile(off1, n)
        k = np.repeat(np.arange(n), len(per))
        j = base // (expand[7] // expand[9])
        count = np.ones(len(base), dtype=np.int64)
    kind, sr, sb, si, dr, db, di, _, ch, par, scope = expand
    if n > 1:
        si, di = (si + base) * n + k, (di + base) * n + k
    else:
        si, di = si + base, di + base
    multi = par > 1
    lane_key = (k * (int(scope.max()) + 1) + np.where(multi, scope, 0)) * (int(par.max()) + 1) + np.where(multi, j, 0)
    keys = unique(lane_key)
    return (kind, sr, sb, si, dr, db, di, count, np.searchsorted(keys, lane_key), ch), len(keys)


def _lower(ops) -> Instrs:
    """A local op is one instruction; a remote one a send then a receive (``r`` or ``rrc``). Each column is
    one repeat (values both instructions share) or one scatter per part; buffers and types are int8."""
    kind, sr, sb, si, dr, db, di, count, lane, ch = ops
    remote = sr != dr
    reps = remote.astype(np.int64) + 1
    first = np.cumsum(reps) - reps                  # row of each op's first instruction
    second = first[remote] + 1                      # row of each remote op's receive
    nins = len(kind) + len(second)

    def col(a_first, a_second, dtype=np.int64):
        """Per op, its first instruction's value and (remote ops) its second's."""
        out = np.empty(nins, dtype=dtype)
        out[first] = a_first
        out[second] = a_second[remote] if np.ndim(a_second) else a_second
        return out

    def both(a, dtype=np.int64):
        return np.repeat(a.astype(dtype, copy=False), reps)
    is_copy = kind == COPY
    recv, msg_from, msg_to = (np.full(nins, -1, dtype=np.int64) for _ in range(3))
    recv[second] = sr[remote]
    msg_from[second] = second - 1
    msg_to[second - 1] = second
    return Instrs(
        rank=col(sr, dr), type=col(np.where(remote, SEND, np.where(is_copy, CPY, RE)),
                                   np.where(is_copy, RECV, RRC), np.int8),
        src_buf=col(sb, np.where(is_copy, sb, db), np.int8), src_idx=col(si, np.where(is_copy, si, di)),
        dst_buf=both(db, np.int8), dst_idx=both(di), cnt=both(count), lane=both(lane), ch=both(ch),
        send=col(np.where(remote, dr, -1), -1), recv=recv, msg_from=msg_from, msg_to=msg_to)


@dataclass
class Accesses:
    """Chunk accesses sorted by slot, then instruction: ``write`` when the instruction writes the slot,
    ``read`` when it reads it (first, as lowered: a reduce reads what it writes)."""

    slot: np.ndarray         # (rank * 3 + buffer code) * span + index
    instr: np.ndarray
    read: np.ndarray
    write: np.ndarray
    span: int


def _accesses(ins: Instrs) -> Accesses:
    t = ins.type
    span = int(max((ins.src_idx + ins.cnt).max(initial=1), (ins.dst_idx + ins.cnt).max(initial=1)))
    reads_src = (t == SEND) | (t == CPY) | (t == RE)
    touches_dst = t != SEND
    reads_dst = (t == RRC) | (t == RRCS) | (t == RRS) | (t == RE)
    parts = []
    for mask, buf, idx, rd, wr in ((reads_src, ins.src_buf, ins.src_idx, True, False),
                                   (touches_dst, ins.dst_buf, ins.dst_idx, None, True)):
        rows = np.flatnonzero(mask)
        cnt = ins.cnt[rows]
        if (cnt == 1).all():     # one chunk each (the usual case): no expansion
            rep, at = rows, idx[rows]
        else:
            rep = np.repeat(rows, cnt)
            at = idx[rep] + np.arange(len(rep)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        slot = (ins.rank[rep] * 3 + buf[rep]) * span + at
        flags = (reads_dst[rep].astype(np.int64) << 1) | wr if rd is None else np.full(len(rep), 2 * rd + wr)
        parts.append((slot, rep, flags))
    slot, instr, flags = (np.concatenate(c) for c in zip(*parts))
    n = len(ins)
    bits = bit_width(n)
    if slot.max(initial=0) < 1 << (61 - bits):   # one sort of (slot, instruction, read, write) codes
        code = slot << bits
        code |= instr
        code <<= 2
        code |= flags
        del slot, instr, flags
        code.sort()
        read, write = (code & 2) > 0, (code & 1) > 0
        code >>= 2
        slot, instr = code >> bits, code & ((1 << bits) - 1)
        del code
    else:
        order = np.lexsort((instr, slot))
        slot, instr, flags = slot[order], instr[order], flags[order]
        read, write = (flags & 2) > 0, (flags & 1) > 0
    # one access per (slot, instruction): a copy whose source and destination overlap reads and writes
    dup = np.flatnonzero((slot[1:] == slot[:-1]) & (instr[1:] == instr[:-1])) + 1
    if len(dup):
        read[dup - 1] |= read[dup]
        write[dup - 1] |= write[dup]
        keep = np.ones(len(slot), dtype=bool)
        keep[dup] = False
        slot, instr, read, write = slot[keep], instr[keep], read[keep], write[keep]
    return Accesses(slot, instr, read, write, span)


def _group_bounds(slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end (exclusive) of each element's run of equal slots."""
    n = len(slot)
    new = np.ones(n, dtype=bool)
    new[1:] = slot[1:] != slot[:-1]
    starts = np.flatnonzero(new)
    lens = np.diff(np.append(starts, n))
    return np.repeat(starts, lens), np.repeat(starts + lens, lens)


def _dependencies(acc: Accesses, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(producer, consumer) instruction pairs, distinct, sorted by (producer, consumer): every access waits
    for the slot's previous write, every write for the reads since then."""
    L = len(acc.slot)
    pos = np.arange(L)
    start, end = _group_bounds(acc.slot)
    w = acc.write
    last_w = np.maximum.accumulate(np.where(w, pos, -1))
    prev_w = np.empty(L, dtype=np.int64)
    prev_w[0] = -1
    prev_w[1:] = last_w[:-1]
    del last_w
    a = prev_w >= start
    del start
    next_w = np.minimum.accumulate(np.where(w, pos, L)[::-1])[::-1]
    del pos
    nxt = np.empty(L, dtype=np.int64)
    nxt[-1:] = L
    nxt[:-1] = next_w[1:]
    del next_w
    b = ~w & (nxt < end)
    del end
    bits = bit_width(n)
    code = np.concatenate((acc.instr[prev_w[a]], acc.instr[b]))
    code <<= bits
    code |= np.concatenate((acc.instr[a], acc.instr[nxt[b]]))
    del prev_w, nxt, a, b
    key = unique(code, overwrite=True)
    return key >> bits, key & ((1 << bits) - 1)


def _fuse(ins: Instrs, dep_src: np.ndarray, dep_dst: np.ndarray):
    """Fold each send into the receive that is its only input; returns the live rows and the dependencies
    rewritten onto them."""
    n = len(ins)
    indeg = np.bincount(dep_dst, minlength=n)
    cand = (ins.type[dep_dst] == SEND) & (indeg[dep_dst] == 1)
    p, s = dep_src[cand], dep_dst[cand]
    ok = ((ins.type[p] == RECV) | (ins.type[p] == RRC)) & (ins.dst_buf[p] == ins.src_buf[s]) & (
        ins.dst_idx[p] == ins.src_idx[s]) & (ins.cnt[p] == ins.cnt[s]) & (ins.lane[p] == ins.lane[s])
    p, s = p[ok], s[ok]
    comm = (ins.send >= 0) | (ins.recv >= 0)
    directives = unique(ins.ch[comm & (ins.ch >= 0)])
    if len(directives) > 1 and (ins.ch[comm] < 0).any():
        p, s = _fuse_in_order(ins, p, s)
    else:
        if len(directives) > 1:   # every op has its directive: a chain's directive is any member's
            same = ins.ch[p] == ins.ch[s]
            p, s = p[same], s[same]
        order = order_by(p, s)   # the first send (lowest id) fuses into a receive
        p, s = p[order], s[order]
        first = np.ones(len(p), dtype=bool)
        first[1:] = p[1:] != p[:-1]
        p, s = p[first], s[first]
    if not len(p):          # nothing fuses: the dependencies stay as they are (distinct, sorted, no loop)
        return np.ones(n, dtype=bool), dep_src, dep_dst
    ins.type[p] = np.where(ins.type[p] == RECV, RCS, RRCS)
    ins.send[p] = ins.send[s]
    ins.msg_to[p] = ins.msg_to[s]
    ins.ch[p] = np.where(ins.ch[p] >= 0, ins.ch[p], ins.ch[s])
    ins.msg_from[ins.msg_to[s]] = p
    alive = np.ones(n, dtype=bool)
    alive[s] = False
    into = np.arange(n)
    into[s] = p
    keep = alive[dep_dst]
    src, dst = into[dep_src[keep]], dep_dst[keep]
    keep = src != dst
    bits = bit_width(n)
    code = src[keep]
    code <<= bits
    code |= dst[keep]
    del src, dst, keep
    key = unique(code, overwrite=True)
    return alive, key >> bits, key & ((1 << bits) - 1)


def _fuse_in_order(ins: Instrs, p: np.ndarray, s: np.ndarray):
    """Fusion with channel directives on some chains only: a chain's directive is known only once the
    chains before it are joined, so the candidates (sorted by send) are replayed in order; O(N) Python."""
    parent = {}

    def root(x):
        while parent.get(x, x) != x:
            x = parent[x]
        return x
    directive = {}
    for i in np.flatnonzero(ins.msg_to >= 0).tolist():   # a send and its receive form one chain
        j = int(ins.msg_to[i])
        parent[j] = i
        directive[i] = int(ins.ch[i]) if ins.ch[i] >= 0 else (int(ins.ch[j]) if ins.ch[j] >= 0 else None)
    fused, used = [], set()
    order = np.argsort(s, kind="stable")
    for pi, si in zip(p[order].tolist(), s[order].tolist()):
        if pi in used:
            continue
        rp, rs = root(pi), root(si)
        dp, ds = directive.get(rp), directive.get(rs)
        if dp is not None and ds is not None and dp != ds:
            continue
        if rp != rs:
            parent[rs] = rp
            directive[rp] = dp if dp is not None else ds
        used.add(pi)
        fused.append((pi, si))
    arr = np.array(fused, dtype=np.int64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def _dead_writes(ins: Instrs, acc: Accesses, alive: np.ndarray, is_output) -> None:
    """An ``rrcs`` whose written slots are next accessed (by a live instruction) by a plain write, or never
    and are not an output, becomes ``rrs``; O(A)."""
    if not (ins.type[alive] == RRCS).any():
        return
    keep = alive[acc.instr]
    slot, instr, read = acc.slot[keep], acc.instr[keep], acc.read[keep]
    at = np.flatnonzero(ins.type[instr] == RRCS)
    _, end = _group_bounds(slot)
    has_next = at + 1 < end[at]
    nxt = np.minimum(at + 1, len(slot) - 1)
    dead = np.where(has_next, ~read[nxt], False)    # the next access is a plain write
    last = np.flatnonzero(~has_next)
    if len(last):
        rank_buf, idx = np.divmod(slot[at[last]], acc.span)
        rank, buf = np.divmod(rank_buf, 3)
        dead[last] = ~is_output(rank, buf, idx)
    bad = np.bincount(instr[at], weights=(~dead).astype(np.float64), minlength=len(ins)) > 0
    rrcs = np.flatnonzero(alive & (ins.type == RRCS) & ~bad)
    ins.type[rrcs] = RRS


def compile_program(prog: GC3Program, sm_count: int = DEFAULT_SM_COUNT, verify_result: bool = True) -> Program:
    """Compile a traced GC3 program into the IR (objects); raise ``UserError`` naming any defect."""
    return compile_table(prog, sm_count, verify_result).to_program()


def compile_algorithm(name: str, ranks: int, channels: int = 1, instances: int = 1,
                      protocol: Protocol | str = Protocol.SIMPLE, nodes: int = 1) -> Program:
    """Algorithm ``name`` of the library (kernels.gc3.algorithms) compiled and verified for ``ranks`` ranks:
    what ``python -m kernels compile NAME --ranks N`` writes, as objects."""
    return compile_program(build(name, ranks, channels, instances, protocol, nodes))


def compile_table(prog: GC3Program, sm_count: int = DEFAULT_SM_COUNT, verify_result: bool = True) -> IRTable:
    """Compile a traced GC3 program into the columnar IR; raise ``UserError`` naming any defect."""
    prog.check_postcondition()
    if not len(prog.ops):
        raise UserError(f"program {prog.name!r} has no operations")
    ops, nlanes = _replicate(prog)
    ins = _lower(ops)
    del ops
    acc = _accesses(ins)
    dep_src, dep_dst = _dependencies(acc, len(ins))
    alive, dep_src, dep_dst = _fuse(ins, dep_src, dep_dst)
    spec, n = prog.spec, prog.instances
    _dead_writes(ins, acc, alive, lambda r, b, i: spec.is_output(r, b, i // n))
    del acc
    if not alive.all():
        rows = np.flatnonzero(alive)
        new = np.full(len(ins), -1, dtype=np.int64)
        new[rows] = np.arange(len(rows))
        ins = ins.take(rows)
        dep_src, dep_dst = new[dep_src], new[dep_dst]
    order = global_order(len(ins), dep_src, dep_dst, ins.msg_from)
    placed = place(ins, dep_src, dep_dst, order, sm_count)
    peers = int(prog.spec.ranks) + 1
    conn = ((ins.rank * peers + ins.send + 1) * nlanes + ins.lane) * (int(ins.ch.max()) + 1) + ins.ch
    seq = step_order(order, conn, ins.msg_from, dep_src, dep_dst)
    del conn, order
    table = emit(prog, ins, dep_src, dep_dst, placed, nlanes, seq)
    if verify_result:
        verify(table, sm_count=sm_count)
    return table
