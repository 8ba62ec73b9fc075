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
4. Channels: instructions linked by messages form a chain that must share one
   channel; its channel is its directive if any, else the lowest channel on
   which every instruction fits a thread block (at most one send peer, one
   receive peer and one channel per thread block; one thread block per
   (peer, channel) and direction on a GPU). Physical channel = virtual channel
   + lane * (virtual channels used).
5. Thread blocks (§5.2, greedily): chains are placed in the global order below;
   an instruction joins the thread block that already owns its connection, else
   one with a free compatible slot (preferring the opposite direction to the same
   peer), else a new one; local copies and reductions join the thread block of
   their latest producer. Each thread block runs its instructions in one global
   topological order: by dependency depth, then by decreasing reverse depth.
6. Cross-thread-block dependencies become ``deps`` (the latest step of each
   producing thread block) and ``has_dep`` on the producers.
The result is checked by ``kernels.gc3.verify`` (deadlock, SM count).

Complexity, for n traced ops moving c chunks in all, N instructions, D data
dependencies (one per chunk access at most, so D = O(c)) and P peers of a rank:
replication O(n * instances + c); lowering and the dependency DAG O(N + c);
fusion O(N + D) (successors are indexed, not searched); dead writes O(N + c)
in one backward pass; depths O(N + D) in one forward and one backward pass;
the global order O(N log N) (one sort; the priority queue is only used if a
connection's receives would leave the send order); channels O(N) per candidate
channel of a chain (a directive, or the first free one); thread blocks
O(N + P log P) per (rank, lane, channel); deps O(N + D). Memory O(N + c).
"""
from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from calibrate.errors import UserError
from kernels.gc3.dsl import OP_CH, OP_COUNT, OP_DST, OP_KIND, OP_PARALLEL, OP_SCOPE, OP_SRC, GC3Program, Slot
from kernels.gc3.ir import Buffer, Gpu, Program, Step, StepType, ThreadBlock
from kernels.gc3.verify import DEFAULT_SM_COUNT, verify

_SEND, _RECV, _RRC = StepType.SEND, StepType.RECV, StepType.RECV_REDUCE_COPY
_RCS, _RRCS, _RRS = StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_COPY_SEND, StepType.RECV_REDUCE_SEND


@dataclass(slots=True)
class Instr:
    id: int
    rank: int
    type: StepType
    src: Slot
    dst: Slot
    cnt: int
    lane: int
    ch: int | None
    send: int = -1
    recv: int = -1
    deps: list | None = None                    # same-rank data dependencies (instr ids, distinct)
    msg_from: int | None = None                 # the instr whose send this one receives
    msg_to: int | None = None
    alive: bool = True


def _replicate(prog: GC3Program) -> tuple[list[tuple], Iterable[tuple]]:
    """The sorted lane keys, and (kind, src, dst, count, lane key, ch) per physical op (made as they
    are read when there is one lane); O(ops * instances + chunks)."""
    n = prog.instances
    out = []
    if n == 1 and all(op[OP_PARALLEL] == 1 for op in prog.ops):
        lane = (0, 0, 0)
        return [lane], ((op[OP_KIND], op[OP_SRC], op[OP_DST], op[OP_COUNT], lane, op[OP_CH]) for op in prog.ops)
    for k in range(n):
        for op_id, op in enumerate(prog.ops):
            kind, osrc, odst, count, ch, parallel, scope = (op[OP_KIND], op[OP_SRC], op[OP_DST], op[OP_COUNT],
                                                            op[OP_CH], op[OP_PARALLEL], op[OP_SCOPE])
            if count % parallel:
                raise UserError(f"op #{op_id} moves {count} chunks, not divisible by parallelize({parallel})")
            part = count // parallel
            for j in range(parallel):
                lane = (k, scope, j) if parallel > 1 else (k, 0, 0)
                base = j * part
                if n == 1:
                    out.append((kind, (osrc[0], osrc[1], osrc[2] + base), (odst[0], odst[1], odst[2] + base),
                                part, lane, ch))
                    continue
                for q in range(part):
                    off = base + q
                    out.append((kind, (osrc[0], osrc[1], (osrc[2] + off) * n + k),
                                (odst[0], odst[1], (odst[2] + off) * n + k), 1, lane, ch))
    return sorted({op[4] for op in out}), out


def _slots(s: Slot, cnt: int):
    if cnt == 1:
        return [s]
    return [(s[0], s[1], s[2] + k) for k in range(cnt)]


class _Lowering:
    """Ops -> instructions with their data dependencies; O(1) per chunk access."""

    def __init__(self):
        self.instrs: list[Instr] = []
        self.last_write: dict[Slot, int] = {}
        self.readers: dict[Slot, list[int]] = {}

    def add(self, rank, stype, src, dst, cnt, lane, ch, reads, writes) -> Instr:
        iid = len(self.instrs)
        last_write, readers = self.last_write, self.readers
        if cnt == 1 and len(reads) + len(writes) == 1:  # one slot read or written: the common case
            s = src if reads else dst
            w = last_write.get(s)
            if reads:
                deps = [] if w is None else [w]
                rs = readers.get(s)
                if rs is None:
                    readers[s] = [iid]
                else:
                    rs.append(iid)
            else:
                rs = readers.get(s)
                deps = list(rs) if rs else []
                if w is not None and w not in deps:
                    deps.append(w)
                last_write[s] = iid
                readers[s] = None
            ins = Instr(iid, rank, stype, src, dst, cnt, lane, ch, deps=deps)
            self.instrs.append(ins)
            return ins
        deps = set()
        for s in reads:
            w = last_write.get(s)
            if w is not None:
                deps.add(w)
        for s in writes:
            w = last_write.get(s)
            if w is not None:
                deps.add(w)
            rs = readers.get(s)
            if rs:
                deps.update(rs)
        for s in reads:
            rs = readers.get(s)
            if rs is None:
                readers[s] = [iid]
            else:
                rs.append(iid)
        for s in writes:
            last_write[s] = iid
            readers[s] = None
        deps.discard(iid)
        ins = Instr(iid, rank, stype, src, dst, cnt, lane, ch, deps=list(deps) if deps else [])
        self.instrs.append(ins)
        return ins

    def lower(self, ops: Iterable[tuple], lanes: dict) -> None:
        for kind, src, dst, count, lane_key, ch in ops:
            lane = lanes[lane_key]
            srcs, dsts = _slots(src, count), _slots(dst, count)
            if src[0] == dst[0]:
                if kind == "copy":
                    self.add(src[0], StepType.COPY, src, dst, count, lane, ch, srcs, dsts)
                else:
                    self.add(src[0], StepType.REDUCE, src, dst, count, lane, ch, srcs + dsts, dsts)
                continue
            snd = self.add(src[0], _SEND, src, dst, count, lane, ch, srcs, ())
            if kind == "copy":
                rcv = self.add(dst[0], _RECV, src, dst, count, lane, ch, (), dsts)
            else:
                rcv = self.add(dst[0], _RRC, dst, dst, count, lane, ch, dsts, dsts)
            snd.send, rcv.recv = dst[0], src[0]
            snd.msg_to, rcv.msg_from = rcv.id, snd.id


def _fuse(low: _Lowering, is_output) -> None:
    """Fold sends into the receives that feed them, then mark dead writes; O(N + D)."""
    ins = low.instrs
    # chains of messages, with their channel directive: fusion must not join two different directives
    parent = list(range(len(ins)))
    directive = [i.ch for i in ins]

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(a, b):
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[rb] = ra
            directive[ra] = directive[ra] if directive[ra] is not None else directive[rb]

    # with at most one distinct directive in the program, no fusion can join two different ones
    chained = len({d for d in directive if d is not None}) > 1
    succ: dict[int, list[int]] = {}  # successors of sends, the only instructions fused away
    for i in ins:
        if chained and i.msg_to is not None:
            join(i.id, i.msg_to)
        for d in i.deps:
            if ins[d].type == _SEND:
                succ.setdefault(d, []).append(i.id)
    for s in ins:
        if s.type != _SEND or not s.alive or len(s.deps) != 1:
            continue
        p = ins[s.deps[0]]
        if p.type not in (_RECV, _RRC) or p.dst != s.src or p.cnt != s.cnt or p.lane != s.lane:
            continue
        if chained:
            dp, ds = directive[root(p.id)], directive[root(s.id)]
            if dp is not None and ds is not None and dp != ds:
                continue
            join(p.id, s.id)
        p.type = _RCS if p.type == _RECV else _RRCS
        p.send, p.msg_to, p.ch = s.send, s.msg_to, p.ch if p.ch is not None else s.ch
        ins[s.msg_to].msg_from = p.id
        s.alive = False
        for oid in succ.get(s.id, ()):
            other = ins[oid]
            other.deps.remove(s.id)
            if oid != p.id and p.id not in other.deps:
                other.deps.append(p.id)
    _mark_dead_writes(ins, is_output)


def _mark_dead_writes(ins: list[Instr], is_output) -> None:
    """An ``rrcs`` whose written slots are next accessed by a plain write (or never, and are not an
    output) becomes ``rrs``. One backward pass over the live instructions: O(N + c)."""
    if not any(i.alive and i.type == _RRCS for i in ins):
        return
    plain_next: dict[Slot, bool] = {}   # slot -> is its next access (so far, going backward) a plain write
    for p in reversed(ins):
        if not p.alive:
            continue
        t = p.type
        if t == _RRCS:
            dead = True
            for s in _slots(p.dst, p.cnt):
                nxt = plain_next.get(s)
                if (nxt is None and is_output(s)) or nxt is False:
                    dead = False
                    break
            if dead:
                p.type = _RRS
        # the instruction's first access of each slot, as lowered (reads come before writes)
        if t in (_SEND, StepType.COPY, StepType.REDUCE):
            reads = _slots(p.src, p.cnt)
        else:
            reads = []
        if t in (_RRC, _RRCS, _RRS, StepType.REDUCE):
            reads = reads + _slots(p.dst, p.cnt)
        writes = [] if t == _SEND else _slots(p.dst, p.cnt)
        read_set = set(reads)
        for s in writes:
            if s not in read_set:
                plain_next[s] = True
        for s in reads:
            plain_next[s] = False


def _order_keys(instrs: list[Instr], nids: int) -> np.ndarray:
    """The ids of ``instrs`` sorted by (dependency depth, -reverse depth, id); O(N + D) plus a sort."""
    depth = [0] * nids
    rdepth = [0] * nids
    for i in instrs:  # ids follow the trace, a topological order
        d = 0
        for p in i.deps:
            if depth[p] >= d:
                d = depth[p] + 1
        if i.msg_from is not None and depth[i.msg_from] >= d:
            d = depth[i.msg_from] + 1
        depth[i.id] = d
    for i in reversed(instrs):
        r = rdepth[i.id] + 1
        for p in i.deps:
            if rdepth[p] < r:
                rdepth[p] = r
        if i.msg_from is not None and rdepth[i.msg_from] < r:
            rdepth[i.msg_from] = r
    ids = np.fromiter((i.id for i in instrs), dtype=np.int64, count=len(instrs))
    dep = np.asarray(depth, dtype=np.int64)[ids]
    rdep = np.asarray(rdepth, dtype=np.int64)[ids]
    return ids[np.lexsort((ids, -rdep, dep))]


class _Placement:
    """Connections per (rank, lane, virtual channel); thread blocks are made from them at the end.

    An instruction that receives from q and sends to p ties the receive side of
    q and the send side of p to one thread block: a channel is valid for it if
    neither side is already tied to another peer there. Plain sends and receives
    always fit: they join the thread block that owns their side.
    """

    def __init__(self):
        self.pair_s: dict[tuple, dict[int, int]] = defaultdict(dict)  # key -> send peer -> recv peer
        self.pair_r: dict[tuple, dict[int, int]] = defaultdict(dict)
        self.sends: dict[tuple, dict[int, int]] = defaultdict(dict)    # key -> send peer -> messages
        self.recvs: dict[tuple, dict[int, int]] = defaultdict(dict)

    def first_misfit(self, instrs: list, ch: int):
        """The first of ``instrs`` (one chain) that cannot go on channel ``ch``, or None; O(len(instrs))."""
        new_s: dict[tuple, int] = {}
        new_r: dict[tuple, int] = {}
        for i in instrs:
            if i.send < 0 or i.recv < 0:
                continue
            key = (i.rank, i.lane, ch)
            ps, pr = self.pair_s.get(key), self.pair_r.get(key)
            have_r = new_s.get((key, i.send), ps.get(i.send, i.recv) if ps else i.recv)
            have_s = new_r.get((key, i.recv), pr.get(i.recv, i.send) if pr else i.send)
            if have_r != i.recv or have_s != i.send:
                return i
            new_s[(key, i.send)], new_r[(key, i.recv)] = i.recv, i.send
        return None

    def add(self, key, send, recv) -> None:
        if send >= 0:
            m = self.sends[key]
            m[send] = m.get(send, 0) + 1
        if recv >= 0:
            m = self.recvs[key]
            m[recv] = m.get(recv, 0) + 1
        if send >= 0 and recv >= 0:
            self.pair_s[key][send] = recv
            self.pair_r[key][recv] = send

    def threadblocks(self, key) -> list[tuple[int, int]]:
        """(send, recv) of each thread block on ``key``: tied pairs, then same-peer pairs, then singles;
        O(P log P) for P peers."""
        pair_s, pair_r = self.pair_s.get(key, {}), self.pair_r.get(key, {})
        sends, recvs = self.sends.get(key, {}), self.recvs.get(key, {})
        tbs = sorted(pair_s.items())
        free_s = sorted(p for p in sends if p not in pair_s)
        free_r = sorted(p for p in recvs if p not in pair_r)
        single_s = [p for p in free_s if sends[p] == 1]
        single_r = [p for p in free_r if recvs[p] == 1]
        set_r = set(single_r)
        both = [p for p in single_s if p in set_r]  # the same peer both ways first
        tbs += [(p, p) for p in both]
        both_set = set(both)
        single_s = [p for p in single_s if p not in both_set]
        single_r = [p for p in single_r if p not in both_set]
        tbs += list(zip(single_s, single_r))
        done_s = {t[0] for t in tbs}
        done_r = {t[1] for t in tbs}
        tbs += [(p, -1) for p in free_s if p not in done_s]
        tbs += [(-1, p) for p in free_r if p not in done_r]
        return tbs


def _schedule(instrs: list[Instr], order: np.ndarray, ins: list[Instr]) -> list[Instr]:
    """One global order: topological, by the order key first, and receiving in the order of sending on
    every connection (the k-th receive must take the k-th message). The key order is topological (depth
    grows along every edge), so it is the answer unless some receive would overtake; only then the
    priority queue runs. O(N) or O(N log N)."""
    queues: dict[tuple, deque] = defaultdict(deque)
    out = []
    for n in order.tolist():
        i = ins[n]
        if i.msg_from is not None:
            s = ins[i.msg_from]
            q = queues[(s.rank, s.send, s.lane, s.ch)]
            if q[0] != i.msg_from:
                return _schedule_heap(instrs, order, ins)
            q.popleft()
        if i.msg_to is not None:
            queues[(i.rank, i.send, i.lane, i.ch)].append(n)
        out.append(i)
    return out


def _schedule_heap(instrs: list[Instr], order: np.ndarray, ins: list[Instr]) -> list[Instr]:
    rank_of = {n: k for k, n in enumerate(order.tolist())}
    succ = defaultdict(list)
    missing = {}
    for i in instrs:
        preds = set(i.deps) | ({i.msg_from} if i.msg_from is not None else set())
        missing[i.id] = len(preds)
        for p in preds:
            succ[p].append(i.id)

    def conn(send_id):
        s = ins[send_id]
        return (s.rank, s.send, s.lane, s.ch)

    heap = [(rank_of[i.id], i.id) for i in instrs if missing[i.id] == 0]
    heapq.heapify(heap)
    queues: dict[tuple, deque] = defaultdict(deque)   # sends whose receive is not scheduled yet
    parked: dict[tuple, dict[int, int]] = defaultdict(dict)  # conn -> send id -> its parked receive
    result = []
    while heap:
        _, n = heapq.heappop(heap)
        i = ins[n]
        if i.msg_from is not None:
            c = conn(i.msg_from)
            if queues[c][0] != i.msg_from:
                parked[c][i.msg_from] = n
                continue
            queues[c].popleft()
            if queues[c] and queues[c][0] in parked[c]:
                q = parked[c].pop(queues[c][0])
                heapq.heappush(heap, (rank_of[q], q))
        if i.msg_to is not None:
            queues[conn(n)].append(n)
        result.append(i)
        for s_ in succ[n]:
            missing[s_] -= 1
            if missing[s_] == 0:
                heapq.heappush(heap, (rank_of[s_], s_))
    if len(result) != len(instrs):
        raise UserError("cannot order the receives of a connection like its sends (a cycle through a FIFO); "
                        "put the crossing transfers on different channels")
    return result


def compile_program(prog: GC3Program, sm_count: int = DEFAULT_SM_COUNT, verify_result: bool = True) -> Program:
    """Compile a traced GC3 program into the IR; raise ``UserError`` naming any defect."""
    program = _compile(prog, sm_count)  # the compiler's own state is freed before the check
    if verify_result:
        verify(program, sm_count=sm_count)
    return program


def _compile(prog: GC3Program, sm_count: int) -> Program:
    prog.check_postcondition()
    if not prog.ops:
        raise UserError(f"program {prog.name!r} has no operations")
    lane_keys, ops = _replicate(prog)
    lanes = {key: i for i, key in enumerate(lane_keys)}
    low = _Lowering()
    low.lower(ops, lanes)
    del ops
    low.last_write = low.readers = None
    spec = prog.spec
    n = prog.instances

    def is_output(slot):
        return spec.required((slot[0], slot[1], slot[2] // n)) is not None

    _fuse(low, is_output)
    ins = [i if i.alive else None for i in low.instrs]
    del low
    instrs = [i for i in ins if i is not None]
    order = _order_keys(instrs, len(ins))

    # chains of instructions linked by messages share one channel
    parent = list(range(len(ins)))

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i in instrs:
        if i.msg_to is not None:
            parent[root(i.msg_to)] = root(i.id)
    chains: dict[int, list[Instr]] = {}
    for iid in order.tolist():
        i = ins[iid]
        if i.send >= 0 or i.recv >= 0:
            chains.setdefault(root(iid), []).append(i)
    place = _Placement()
    for comm in chains.values():
        directives = {i.ch for i in comm if i.ch is not None}
        if len(directives) > 1:
            raise UserError(f"instructions chained by messages have different channel directives "
                            f"{sorted(directives)} (around rank {comm[0].rank}); give one chain one channel")
        cands = list(directives) or range(sm_count + 1)
        for ch in cands:
            bad = place.first_misfit(comm, ch)
            if bad is None:
                break
        else:
            raise UserError(f"rank {bad.rank}: {bad.type.value} (send to {bad.send}, receive from {bad.recv}) does "
                            f"not fit channel {cands[0]}: a thread block there already pairs one of these peers "
                            f"with another; give this chain another channel directive")
        for i in comm:
            i.ch = ch
            place.add((i.rank, i.lane, ch), i.send, i.recv)
    del chains
    tb_list = {}
    for tkey in sorted(set(place.sends) | set(place.recvs)):
        tb_list[tkey] = place.threadblocks(tkey)
    # thread block index lookups: exact (send, recv) pair, first by send peer, first by receive peer
    find: dict[tuple, tuple[dict, dict, dict]] = {}
    for tkey, tbs in tb_list.items():
        by_pair, by_s, by_r = {}, {}, {}
        for k, (s_, r_) in enumerate(tbs):
            by_pair.setdefault((s_, r_), k)
            by_s.setdefault(s_, k)
            by_r.setdefault(r_, k)
        find[tkey] = (by_pair, by_s, by_r)
    order_list = order.tolist()
    position = [0] * len(ins)
    for k, iid in enumerate(order_list):
        position[iid] = k
    # thread block of each instruction: an index into tb_keys ((rank, lane, channel, index on that key))
    tb_key_id: dict[tuple, int] = {}
    tb_keys: list[tuple] = []
    tb_of = [-1] * len(ins)

    def tb_index(key: tuple) -> int:
        t = tb_key_id.get(key)
        if t is None:
            t = tb_key_id[key] = len(tb_keys)
            tb_keys.append(key)
        return t
    for iid in order_list:
        i = ins[iid]
        if i.send >= 0 or i.recv >= 0:
            by_pair, by_s, by_r = find[(i.rank, i.lane, i.ch)]
            if i.send >= 0 and i.recv >= 0:
                k = by_pair[(i.send, i.recv)]
            elif i.send >= 0:
                k = by_s[i.send]
            else:
                k = by_r[i.recv]
            tb_of[iid] = tb_index((i.rank, i.lane, i.ch, k))
            continue
        best = None
        for d in i.deps:
            if tb_of[d] >= 0 and (best is None or position[d] > position[best]):
                best = d
        if best is not None:
            tb_of[iid] = tb_of[best]
        else:
            k = (i.rank, i.lane, i.ch or 0)
            tb_list.setdefault(k, [(-1, -1)])
            tb_of[iid] = tb_index((*k, 0))
    return _emit(prog, instrs, ins, order, [tb_keys[t] if t >= 0 else None for t in tb_of], tb_list, lane_keys)


def _emit(prog, instrs, ins, order, tb_of, tb_list, lane_keys) -> Program:
    """Thread blocks, steps in the global order and cross-thread-block deps; O(N + D)."""
    spec, n = prog.spec, prog.instances
    nv = max((k[2] for k in tb_list), default=0) + 1
    tb_ids: dict[tuple, int] = {}
    gpus = []
    keys_of = defaultdict(list)
    for k in sorted(tb_list):
        keys_of[k[0]].append(k)
    for r in range(spec.ranks):
        tbs = []
        for k in keys_of[r]:
            for idx, (send, recv) in enumerate(tb_list[k]):
                tb_ids[(*k, idx)] = len(tbs)
                tbs.append(ThreadBlock(id=len(tbs), send=send, recv=recv, chan=k[2] + k[1] * nv))
        nin = spec.buffer_chunks(r, Buffer.INPUT) or 0
        nout = spec.buffer_chunks(r, Buffer.OUTPUT) or 0
        sizes = {Buffer.INPUT: nin * n, Buffer.OUTPUT: nout * n, Buffer.SCRATCH: prog.scratch_chunks[r] * n}
        if spec.inplace and spec.kind in ("allreduce", "reducescatter"):
            sizes[Buffer.OUTPUT] = 0
        if spec.inplace and spec.kind == "allgather":
            sizes[Buffer.INPUT] = 0
        gpus.append(Gpu(r, sizes[Buffer.INPUT], sizes[Buffer.OUTPUT], sizes[Buffer.SCRATCH], tbs))
    pos_tb = [0] * len(ins)
    pos_step = [0] * len(ins)
    for i in _schedule(instrs, order, ins):
        tb = gpus[i.rank].threadblocks[tb_ids[tb_of[i.id]]]
        pos_tb[i.id], pos_step[i.id] = tb.id, len(tb.steps)
        tb.steps.append(Step(len(tb.steps), i.type, i.src[1], i.src[2], i.dst[1], i.dst[2], i.cnt))
    for i in instrs:
        if not i.deps:
            continue
        tbid = pos_tb[i.id]
        latest: dict[int, int] = {}
        for d in i.deps:
            dt, ds = pos_tb[d], pos_step[d]
            if dt != tbid and latest.get(dt, -1) < ds:
                latest[dt] = ds
        if not latest:
            continue
        tbs = gpus[i.rank].threadblocks
        step = tbs[tbid].steps[pos_step[i.id]]
        step.deps = sorted(latest.items())
        for dt, ds in step.deps:
            tbs[dt].steps[ds].has_dep = True
    return Program(name=prog.name, collective=spec.kind, ngpus=spec.ranks, nchunksperloop=spec.chunks * n,
                   nchannels=nv * len(lane_keys), protocol=prog.protocol, inplace=spec.inplace, gpus=gpus)
