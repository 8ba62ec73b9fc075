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
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

from calibrate.errors import UserError
from kernels.gc3.dsl import GC3Program, Slot
from kernels.gc3.ir import Buffer, Gpu, Program, Step, StepType, ThreadBlock
from kernels.gc3.verify import DEFAULT_SM_COUNT, verify


@dataclass
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
    deps: set = field(default_factory=set)      # same-rank data dependencies (instr ids)
    msg_from: int | None = None                 # the instr whose send this one receives
    msg_to: int | None = None
    alive: bool = True


@dataclass
class _PhysOp:
    kind: str
    src: Slot
    dst: Slot
    count: int
    lane: tuple
    ch: int | None


def _replicate(prog: GC3Program) -> list[_PhysOp]:
    n = prog.instances
    out = []
    for k in range(n):
        for op in prog.ops:
            if op.count % op.parallel:
                raise UserError(f"op #{op.id} moves {op.count} chunks, not divisible by parallelize({op.parallel})")
            part = op.count // op.parallel
            for j in range(op.parallel):
                lane = (k, op.scope, j) if op.parallel > 1 else (k, 0, 0)
                base = j * part
                pieces = [(base + q, 1) for q in range(part)] if n > 1 else [(base, part)]
                for off, cnt in pieces:
                    src = (op.src[0], op.src[1], (op.src[2] + off) * n + k)
                    dst = (op.dst[0], op.dst[1], (op.dst[2] + off) * n + k)
                    out.append(_PhysOp(op.kind, src, dst, cnt, lane, op.ch))
    return out


def _slots(s: Slot, cnt: int):
    return [(s[0], s[1], s[2] + k) for k in range(cnt)]


class _Lowering:
    def __init__(self):
        self.instrs: list[Instr] = []
        self.last_write: dict[Slot, int] = {}
        self.readers: dict[Slot, list[int]] = defaultdict(list)
        self.accesses: dict[Slot, list[tuple[int, str]]] = defaultdict(list)

    def add(self, rank, stype, src, dst, cnt, lane, ch, reads, writes) -> Instr:
        ins = Instr(len(self.instrs), rank, stype, src, dst, cnt, lane, ch)
        for s in reads:
            if s in self.last_write:
                ins.deps.add(self.last_write[s])
        for s in writes:
            if s in self.last_write:
                ins.deps.add(self.last_write[s])
            ins.deps.update(self.readers[s])
        for s in reads:
            self.readers[s].append(ins.id)
            self.accesses[s].append((ins.id, "r"))
        for s in writes:
            self.last_write[s] = ins.id
            self.readers[s] = []
            self.accesses[s].append((ins.id, "rw" if s in reads else "w"))
        ins.deps.discard(ins.id)
        self.instrs.append(ins)
        return ins

    def lower(self, ops: list[_PhysOp], lanes: dict) -> None:
        for op in ops:
            lane = lanes[op.lane]
            srcs, dsts = _slots(op.src, op.count), _slots(op.dst, op.count)
            if op.src[0] == op.dst[0]:
                if op.kind == "copy":
                    self.add(op.src[0], StepType.COPY, op.src, op.dst, op.count, lane, op.ch, srcs, dsts)
                else:
                    self.add(op.src[0], StepType.REDUCE, op.src, op.dst, op.count, lane, op.ch, srcs + dsts, dsts)
                continue
            snd = self.add(op.src[0], StepType.SEND, op.src, op.dst, op.count, lane, op.ch, srcs, [])
            if op.kind == "copy":
                rcv = self.add(op.dst[0], StepType.RECV, op.src, op.dst, op.count, lane, op.ch, [], dsts)
            else:
                rcv = self.add(op.dst[0], StepType.RECV_REDUCE_COPY, op.dst, op.dst, op.count, lane, op.ch,
                               dsts, dsts)
            snd.send, rcv.recv = op.dst[0], op.src[0]
            snd.msg_to, rcv.msg_from = rcv.id, snd.id


def _fuse(low: _Lowering, output_slots: set) -> None:
    ins = low.instrs
    # chains of messages, with their channel directive: fusion must not join two different directives
    parent = list(range(len(ins)))
    directive = {i.id: i.ch for i in ins}

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

    for i in ins:
        if i.msg_to is not None:
            join(i.id, i.msg_to)
    for s in ins:
        if s.type != StepType.SEND or not s.alive or len(s.deps) != 1:
            continue
        p = ins[next(iter(s.deps))]
        dp, ds = directive[root(p.id)], directive[root(s.id)]
        if (p.type not in (StepType.RECV, StepType.RECV_REDUCE_COPY) or p.dst != s.src or p.cnt != s.cnt
                or p.lane != s.lane or (dp is not None and ds is not None and dp != ds)):
            continue
        join(p.id, s.id)
        p.type = StepType.RECV_COPY_SEND if p.type == StepType.RECV else StepType.RECV_REDUCE_COPY_SEND
        p.send, p.msg_to, p.ch = s.send, s.msg_to, p.ch if p.ch is not None else s.ch
        ins[s.msg_to].msg_from = p.id
        s.alive = False
        for other in ins:
            if s.id in other.deps:
                other.deps.discard(s.id)
                if other.id != p.id:
                    other.deps.add(p.id)
    for p in ins:
        if p.alive and p.type == StepType.RECV_REDUCE_COPY_SEND and _dead_write(low, p, output_slots):
            p.type = StepType.RECV_REDUCE_SEND


def _dead_write(low: _Lowering, p: Instr, output_slots: set) -> bool:
    for s in _slots(p.dst, p.cnt):
        acc = [(i, kind) for i, kind in low.accesses[s] if low.instrs[i].alive or i == p.id]
        pos = [i for i, _ in acc].index(p.id)
        later = [(i, kind) for i, kind in acc[pos + 1:] if i != p.id]
        if later:
            if later[0][1] != "w":
                return False
        elif s in output_slots:
            return False
    return True


def _depths(instrs: list[Instr]) -> tuple[dict, dict]:
    succ = defaultdict(list)
    for i in instrs:
        for d in i.deps:
            succ[d].append(i.id)
        if i.msg_from is not None:
            succ[i.msg_from].append(i.id)
    order = sorted(instrs, key=lambda i: i.id)  # ids follow the trace, a topological order
    depth = {}
    for i in order:
        preds = list(i.deps) + ([i.msg_from] if i.msg_from is not None else [])
        depth[i.id] = max((depth[p] + 1 for p in preds), default=0)
    rdepth = {}
    for i in reversed(order):
        rdepth[i.id] = max((rdepth[s] + 1 for s in succ[i.id]), default=0)
    return depth, rdepth


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
        self.sends: dict[tuple, set] = defaultdict(set)
        self.recvs: dict[tuple, set] = defaultdict(set)
        self.messages: dict[tuple, int] = defaultdict(int)  # (key, "s"|"r", peer) -> messages

    def first_misfit(self, instrs: list, ch: int):
        """The first of ``instrs`` (one chain) that cannot go on channel ``ch``, or None."""
        new_s: dict[tuple, int] = {}
        new_r: dict[tuple, int] = {}
        for i in instrs:
            if i.send < 0 or i.recv < 0:
                continue
            key = (i.rank, i.lane, ch)
            have_r = new_s.get((key, i.send), self.pair_s[key].get(i.send, i.recv))
            have_s = new_r.get((key, i.recv), self.pair_r[key].get(i.recv, i.send))
            if have_r != i.recv or have_s != i.send:
                return i
            new_s[(key, i.send)], new_r[(key, i.recv)] = i.recv, i.send
        return None

    def add(self, key, send, recv) -> None:
        if send >= 0:
            self.sends[key].add(send)
            self.messages[(key, "s", send)] += 1
        if recv >= 0:
            self.recvs[key].add(recv)
            self.messages[(key, "r", recv)] += 1
        if send >= 0 and recv >= 0:
            self.pair_s[key][send] = recv
            self.pair_r[key][recv] = send

    def threadblocks(self, key) -> list[tuple[int, int]]:
        """(send, recv) of each thread block on ``key``: tied pairs, then same-peer pairs, then singles."""
        tbs = sorted(self.pair_s[key].items())
        free_s = sorted(self.sends[key] - set(self.pair_s[key]))
        free_r = sorted(self.recvs[key] - set(self.pair_r[key]))
        single_s = [p for p in free_s if self.messages[(key, "s", p)] == 1]
        single_r = [p for p in free_r if self.messages[(key, "r", p)] == 1]
        for p in [p for p in single_s if p in single_r]:  # the same peer both ways first
            tbs.append((p, p))
            single_s.remove(p)
            single_r.remove(p)
        for a, b in zip(list(single_s), list(single_r)):
            tbs.append((a, b))
            single_s.remove(a)
            single_r.remove(b)
        done_s = {t[0] for t in tbs}
        done_r = {t[1] for t in tbs}
        tbs += [(p, -1) for p in free_s if p not in done_s]
        tbs += [(-1, p) for p in free_r if p not in done_r]
        return tbs


def _schedule(instrs: list[Instr], key: dict) -> list[Instr]:
    """One global order: topological, by ``key`` first, and receiving in the order of sending on every
    connection (the k-th receive must take the k-th message)."""
    by_id = {i.id: i for i in instrs}
    succ = defaultdict(list)
    missing = {}
    for i in instrs:
        preds = set(i.deps) | ({i.msg_from} if i.msg_from is not None else set())
        missing[i.id] = len(preds)
        for p in preds:
            succ[p].append(i.id)

    def conn(send_id):
        s = by_id[send_id]
        return (s.rank, s.send, s.lane, s.ch)

    heap = [(key[i.id], i.id) for i in instrs if missing[i.id] == 0]
    heapq.heapify(heap)
    queues: dict[tuple, list[int]] = defaultdict(list)   # sends whose receive is not scheduled yet
    parked: dict[tuple, list[int]] = defaultdict(list)
    order = []
    while heap:
        _, n = heapq.heappop(heap)
        i = by_id[n]
        if i.msg_from is not None:
            c = conn(i.msg_from)
            if queues[c][0] != i.msg_from:
                parked[c].append(n)
                continue
            queues[c].pop(0)
            for q in [q for q in parked[c] if queues[c] and by_id[q].msg_from == queues[c][0]]:
                parked[c].remove(q)
                heapq.heappush(heap, (key[q], q))
        if i.msg_to is not None:
            c = conn(n)
            queues[c].append(n)
        order.append(i)
        for s_ in succ[n]:
            missing[s_] -= 1
            if missing[s_] == 0:
                heapq.heappush(heap, (key[s_], s_))
    if len(order) != len(instrs):
        raise UserError("cannot order the receives of a connection like its sends (a cycle through a FIFO); "
                        "put the crossing transfers on different channels")
    return order


def compile_program(prog: GC3Program, sm_count: int = DEFAULT_SM_COUNT, verify_result: bool = True) -> Program:
    """Compile a traced GC3 program into the IR; raise ``UserError`` naming any defect."""
    prog.check_postcondition()
    if not prog.ops:
        raise UserError(f"program {prog.name!r} has no operations")
    ops = _replicate(prog)
    lane_keys = sorted({op.lane for op in ops})
    lanes = {key: i for i, key in enumerate(lane_keys)}
    low = _Lowering()
    low.lower(ops, lanes)
    spec = prog.spec
    n = prog.instances
    outputs = set()
    for (r, b, i) in spec.postcondition:
        outputs.update((r, b, i * n + k) for k in range(n))
    _fuse(low, outputs)
    instrs = [i for i in low.instrs if i.alive]
    depth, rdepth = _depths(instrs)
    key = {i.id: (depth[i.id], -rdepth[i.id], i.id) for i in instrs}
    by_id = {i.id: i for i in instrs}

    # chains of instructions linked by messages share one channel
    parent = {i.id: i.id for i in instrs}

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i in instrs:
        if i.msg_to is not None:
            parent[root(i.msg_to)] = root(i.id)
    chains = defaultdict(list)
    for i in sorted(instrs, key=lambda i: key[i.id]):
        chains[root(i.id)].append(i)
    place = _Placement()
    tb_of: dict[int, tuple] = {}
    for members in chains.values():
        comm = [i for i in members if i.send >= 0 or i.recv >= 0]
        if not comm:
            continue
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
    tb_list = {}
    for tkey in sorted(set(place.sends) | set(place.recvs)):
        tb_list[tkey] = place.threadblocks(tkey)
    for i in sorted(instrs, key=lambda i: key[i.id]):
        if i.send >= 0 or i.recv >= 0:
            tbs = tb_list[(i.rank, i.lane, i.ch)]
            tb_of[i.id] = (i.rank, i.lane, i.ch, next(k for k, (s, r) in enumerate(tbs)
                                                      if (i.send < 0 or s == i.send) and (i.recv < 0 or r == i.recv)))
            continue
        prods = [by_id[d] for d in i.deps if d in tb_of]
        if prods:
            tb_of[i.id] = tb_of[max(prods, key=lambda p: key[p.id]).id]
        else:
            k = (i.rank, i.lane, i.ch or 0)
            tb_list.setdefault(k, [(-1, -1)])
            tb_of[i.id] = (*k, 0)
    return _emit(prog, instrs, tb_of, tb_list, key, lane_keys, sm_count, verify_result)


def _emit(prog, instrs, tb_of, tb_list, key, lane_keys, sm_count, verify_result) -> Program:
    spec, n = prog.spec, prog.instances
    nv = max((k[2] for k in tb_list), default=0) + 1
    tb_ids: dict[tuple, int] = {}
    gpus = []
    for r in range(spec.ranks):
        keys = sorted(k for k in tb_list if k[0] == r)
        tbs = []
        for k in keys:
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
    pos: dict[int, tuple[int, int]] = {}
    for i in _schedule(instrs, key):
        tb = gpus[i.rank].threadblocks[tb_ids[tb_of[i.id]]]
        pos[i.id] = (tb.id, len(tb.steps))
        tb.steps.append(Step(len(tb.steps), i.type, i.src[1], i.src[2], i.dst[1], i.dst[2], i.cnt))
    for i in instrs:
        tbid, s = pos[i.id]
        latest: dict[int, int] = {}
        for d in i.deps:
            dt, ds = pos[d]
            if dt != tbid:
                latest[dt] = max(latest.get(dt, -1), ds)
        step = gpus[i.rank].threadblocks[tbid].steps[s]
        step.deps = sorted(latest.items())
        for dt, ds in step.deps:
            gpus[i.rank].threadblocks[dt].steps[ds].has_dep = True
    program = Program(name=prog.name, collective=spec.kind, ngpus=spec.ranks, nchunksperloop=spec.chunks * n,
                      nchannels=nv * len(lane_keys), protocol=prog.protocol, inplace=spec.inplace, gpus=gpus)
    if verify_result:
        verify(program, sm_count=sm_count)
    return program
