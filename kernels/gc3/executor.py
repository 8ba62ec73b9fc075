"""Reference executor: runs an IR on numpy buffers of all ranks under a random interleaving.

It is the oracle for the GPU interpreter. Model:
- every thread block is a sequential process; a process advances one *phase* at
  a time, chosen at random among the enabled ones (``seed``);
- a step waits for its ``deps`` (other thread blocks' steps having completed);
- a receiving step first receives (needs a message on its connection), then,
  if it also sends, sends (needs a free FIFO slot); a connection is
  (sender, receiver, channel), its k-th send matches its k-th receive and both
  must have the same ``cnt``; a connection holds ``fifo_slots`` messages
  (MSCCL tiles the data so that one step's message fits in the connection's
  buffer, hence 1 is the safe assumption; larger values only remove waits);
- races are found with vector clocks over the happens-before order made of
  program order, dependencies and messages (not FIFO back-pressure): a read or
  a write of a chunk slot not ordered after a conflicting write (or, for a
  write, after the earlier reads) is a race; reads of never-written output or
  scratch slots are reported too;
- no enabled process while some are unfinished is a deadlock, named by the
  steps that wait.
Failures raise ``ExecutionError`` naming the step (gpu, tb, step, type).

Cost, for S steps, P thread blocks and c chunk slots: O(S * P / 64) time per
run (one phase is O(1) bookkeeping: waiting processes are woken by the event
they wait for, no scan of all processes; plus an O(P) vector clock merge per
message or dependency), O(P^2 + c) memory for the clocks and slots. Race checks
need P clock entries per thread block and per awaited step, so when those would
take more than ``RACE_CHECK_MAX_CLOCK_BYTES``, ``check_program`` runs without
them (results, deadlocks and mismatched messages are still checked) and says so.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from kernels.gc3.ir import Buffer, Program, Step, StepType
from kernels.gc3.semantics import alias, custom_name, input_chunks, output_chunks, reference_result, storage_chunks


class ExecutionError(Exception):
    """The program is wrong: deadlock, race, mismatched messages or a wrong result."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def step_name(rank: int, tb: int, idx: int, step: Step) -> str:
    return f"gpu {rank} tb {tb} step {idx} ({step.type.value})"


RACE_CHECK_MAX_CLOCK_BYTES = 256 << 20


@dataclass
class _Access:
    pid: int
    clock: int
    where: tuple  # (rank, thread block, step index)


class _Slot:
    __slots__ = ("write", "reads")

    def __init__(self):
        self.write: _Access | None = None
        self.reads: list[_Access] = []


def _slot(meta: dict, i: int) -> "_Slot":
    """The access record of element ``i``, made on its first access."""
    sl = meta.get(i)
    if sl is None:
        sl = meta[i] = _Slot()
    return sl


class _Run:
    def __init__(self, program: Program, inputs: list[np.ndarray], fifo_slots: int, check_races: bool):
        self.p = program
        self.fifo_slots = fifo_slots
        self.check_races = check_races
        nranks = program.ngpus
        if len(inputs) != nranks:
            raise ValueError(f"need one input per rank ({nranks}), got {len(inputs)}")
        nin = input_chunks(program)
        elems = inputs[0].size
        if elems % nin:
            raise ValueError(f"input of {elems} elements does not split into {nin} chunks")
        self.ce = elems // nin  # elements per chunk
        self.mem: list[dict[Buffer, np.ndarray]] = []
        self.init: list[dict[Buffer, np.ndarray]] = []     # slot written or given as input
        self.slots: list[dict[Buffer, dict[int, _Slot]]] = []  # race metadata of accessed slots
        for r in range(nranks):
            sizes = storage_chunks(program, r)
            mem = {b: np.full((n, self.ce), np.nan, dtype=inputs[r].dtype) for b, n in sizes.items()}
            init = {b: np.zeros(n, dtype=bool) for b, n in sizes.items()}
            for k in range(nin):
                b, off = alias(program, r, Buffer.INPUT, k)
                mem[b][off] = inputs[r][k * self.ce:(k + 1) * self.ce]
                init[b][off] = True
            self.mem.append(mem)
            self.init.append(init)
            self.slots.append({b: {} for b in sizes})
        # processes: one per (rank, thread block)
        self.procs = [(g.id, tb) for g in program.gpus for tb in g.threadblocks]
        self.pid = {(r, tb.id): i for i, (r, tb) in enumerate(self.procs)}
        npr = len(self.procs)
        self.vc = np.zeros((npr, npr), dtype=np.int64) if check_races else None
        self.pc = [0] * npr        # next step index
        self.phase = [0] * npr     # 0: not started, 1: received, waiting to send
        self.carry: list[np.ndarray | None] = [None] * npr
        self.waited = {(g.id, *d) for g in program.gpus for tb in g.threadblocks for st in tb.steps for d in st.deps}
        self.done_vc: dict[tuple[int, int, int], np.ndarray | None] = {}  # completed steps that others wait on
        self.fifo: dict[tuple[int, int, int], deque] = {}
        self.receiver: dict[tuple[int, int, int], list[int]] = {}  # connection -> the processes receiving on it
        self.sender: dict[tuple[int, int, int], list[int]] = {}
        for i, (r, tb) in enumerate(self.procs):
            if tb.recv >= 0:
                self.receiver.setdefault((tb.recv, r, tb.chan), []).append(i)
            if tb.send >= 0:
                self.sender.setdefault((r, tb.send, tb.chan), []).append(i)
        # waiting processes, by what wakes them
        self.on_step: dict[tuple[int, int, int], list[int]] = {}
        self.ready: list[int] = []
        self.where_ready: dict[int, int] = {}

    # ---- memory with race detection ----------------------------------------------------
    def _name(self, loc: tuple) -> str:
        r, tb, idx = loc
        return step_name(r, tb.id, idx, tb.steps[idx])

    def _ordered(self, pid: int, acc: _Access) -> bool:
        return acc.pid == pid or acc.clock <= self.vc[pid, acc.pid]

    def read(self, pid: int, loc: tuple, buf: Buffer, off: int, cnt: int) -> np.ndarray:
        r = loc[0]
        b, o = alias(self.p, r, buf, off)
        init = self.init[r][b]
        if not init[o:o + cnt].all():
            k = int(np.flatnonzero(~init[o:o + cnt])[0])
            raise ExecutionError("uninitialised read", f"{self._name(loc)} reads {buf.value}[{off + k}] on gpu {r}, "
                                 f"which nothing has written yet")
        if self.check_races:
            meta = self.slots[r][b]
            for k in range(cnt):
                sl = _slot(meta, o + k)
                if sl.write is not None and not self._ordered(pid, sl.write):
                    raise ExecutionError("race", f"{self._name(loc)} reads {buf.value}[{off + k}] unordered with the "
                                         f"write by {self._name(sl.write.where)}")
                sl.reads.append(_Access(pid, self.vc[pid, pid], loc))
        return self.mem[r][b][o:o + cnt].copy()

    def write(self, pid: int, loc: tuple, buf: Buffer, off: int, data: np.ndarray) -> None:
        cnt = data.shape[0]
        r = loc[0]
        b, o = alias(self.p, r, buf, off)
        if self.check_races:
            meta = self.slots[r][b]
            for k in range(cnt):
                sl = _slot(meta, o + k)
                for acc in ([sl.write] if sl.write else []) + sl.reads:
                    if not self._ordered(pid, acc):
                        raise ExecutionError("race", f"{self._name(loc)} writes {buf.value}[{off + k}] on gpu {r} "
                                             f"unordered with the access by {self._name(acc.where)}")
                sl.write = _Access(pid, self.vc[pid, pid], loc)
                sl.reads = []
        self.init[r][b][o:o + cnt] = True
        self.mem[r][b][o:o + cnt] = data

    # ---- scheduling ----------------------------------------------------------------------
    def conn_out(self, pid: int) -> tuple[int, int, int]:
        r, tb = self.procs[pid]
        return (r, tb.send, tb.chan)

    def conn_in(self, pid: int) -> tuple[int, int, int]:
        r, tb = self.procs[pid]
        return (tb.recv, r, tb.chan)

    def wait_reason(self, pid: int) -> str | None:
        """None if process ``pid`` can take its next phase, else what it waits for."""
        r, tb = self.procs[pid]
        st = tb.steps[self.pc[pid]]
        if self.phase[pid] == 0:
            for d in st.deps:
                if (r, *d) not in self.done_vc:
                    return f"waits for gpu {r} tb {d[0]} step {d[1]}"
            if st.type.receives and not self.fifo.get(self.conn_in(pid)):
                return f"waits for a message from gpu {tb.recv} on channel {tb.chan}"
            if st.type.receives or not st.type.sends:
                return None
        if len(self.fifo.get(self.conn_out(pid), ())) >= self.fifo_slots:
            return f"waits for a free FIFO slot to gpu {tb.send} on channel {tb.chan}"
        return None

    def _consider(self, pid: int) -> None:
        """Put an unfinished process on the ready list, or register it with what it waits for."""
        if pid in self.where_ready or self.pc[pid] == len(self.procs[pid][1].steps):
            return
        r, tb = self.procs[pid]
        st = tb.steps[self.pc[pid]]
        if self.phase[pid] == 0:
            for d in st.deps:
                key = (r, *d)
                if key not in self.done_vc:
                    self.on_step.setdefault(key, []).append(pid)
                    return
            if st.type.receives and not self.fifo.get(self.conn_in(pid)):
                return  # woken by the sender
        if (self.phase[pid] == 1 or (st.type.sends and not st.type.receives)) and \
                len(self.fifo.get(self.conn_out(pid), ())) >= self.fifo_slots:
            return  # woken by the receiver
        self.where_ready[pid] = len(self.ready)
        self.ready.append(pid)

    def _take(self, k: int) -> int:
        pid, last = self.ready[k], self.ready[-1]
        self.ready[k] = last
        self.where_ready[last] = k
        self.ready.pop()
        del self.where_ready[pid]
        return pid

    def advance(self, pid: int) -> None:
        r, tb = self.procs[pid]
        idx = self.pc[pid]
        st = tb.steps[idx]
        loc = (r, tb, idx)
        vc = self.vc
        if vc is not None:
            vc[pid, pid] += 1
        woken = []
        if self.phase[pid] == 0:
            if vc is not None:
                for d in st.deps:
                    np.maximum(vc[pid], self.done_vc[(r, *d)], out=vc[pid])
            data = self._start(pid, st, loc)
            if st.type.receives:
                woken += self.sender.get(self.conn_in(pid), ())
            if st.type.receives and st.type.sends:
                self.carry[pid] = data
                self.phase[pid] = 1
                woken.append(pid)
                self._wake(woken)
                return
        else:
            data = self.carry[pid]
        if st.type.sends:
            key = self.conn_out(pid)
            self.fifo.setdefault(key, deque()).append((data, None if vc is None else vc[pid].copy(), loc, st.cnt))
            woken += self.receiver.get(key, ())
        done = (r, tb.id, idx)
        if done in self.waited:
            self.done_vc[done] = None if vc is None else vc[pid].copy()
            woken += self.on_step.pop(done, [])
        self.pc[pid] += 1
        self.phase[pid] = 0
        self.carry[pid] = None
        woken.append(pid)
        self._wake(woken)

    def _wake(self, pids: list[int]) -> None:
        for q in pids:
            self._consider(q)

    def _receive(self, pid: int, st: Step, loc: tuple) -> np.ndarray:
        key = self.conn_in(pid)
        data, vc, sloc, scnt = self.fifo[key].popleft()
        if scnt != st.cnt:
            raise ExecutionError("message mismatch", f"{self._name(loc)} receives {st.cnt} chunks but the matching "
                                 f"send {self._name(sloc)} sends {scnt}")
        if vc is not None:
            np.maximum(self.vc[pid], vc, out=self.vc[pid])
        return data

    def _start(self, pid: int, st: Step, loc: tuple) -> np.ndarray | None:
        t = st.type
        if t == StepType.NOP:
            return None
        if t == StepType.SEND:
            return self.read(pid, loc, st.srcbuf, st.srcoff, st.cnt)
        if t == StepType.COPY:
            self.write(pid, loc, st.dstbuf, st.dstoff, self.read(pid, loc, st.srcbuf, st.srcoff, st.cnt))
            return None
        if t == StepType.REDUCE:
            acc = self.read(pid, loc, st.dstbuf, st.dstoff, st.cnt)
            self.write(pid, loc, st.dstbuf, st.dstoff, acc + self.read(pid, loc, st.srcbuf, st.srcoff, st.cnt))
            return None
        data = self._receive(pid, st, loc)
        if t.reduces:
            data = data + self.read(pid, loc, st.srcbuf, st.srcoff, st.cnt)
        if t != StepType.RECV_REDUCE_SEND:
            self.write(pid, loc, st.dstbuf, st.dstoff, data)
        return data

    def run(self, rng: random.Random) -> None:
        for pid in range(len(self.procs)):
            self._consider(pid)
        while self.ready:
            self.advance(self._take(rng.randrange(len(self.ready))))
        live = [i for i, (_, tb) in enumerate(self.procs) if self.pc[i] < len(tb.steps)]
        if live:
            waits = "; ".join(f"{self._name((self.procs[i][0], self.procs[i][1], self.pc[i]))} "
                              f"{self.wait_reason(i)}" for i in live[:6])
            more = f" (and {len(live) - 6} more)" if len(live) > 6 else ""
            raise ExecutionError("deadlock", f"no thread block can progress: {waits}{more}")
        for key, q in self.fifo.items():
            if q:
                raise ExecutionError("unmatched send", f"{self._name(q[0][2])} sends to gpu {key[1]} on channel "
                                     f"{key[2]} but no step receives it")

    def outputs(self) -> list[np.ndarray | None]:
        out = []
        for r in range(self.p.ngpus):
            n = output_chunks(self.p, r)
            if n == 0:
                out.append(None)
                continue
            rows = []
            for k in range(n):
                b, o = alias(self.p, r, Buffer.OUTPUT, k)
                rows.append(self.mem[r][b][o])
            out.append(np.concatenate(rows))
        return out


def execute(program: Program, inputs: list[np.ndarray], seed: int = 0, fifo_slots: int = 1,
            check_races: bool = True) -> list[np.ndarray | None]:
    """Run ``program`` on flat per-rank ``inputs``; return each rank's flat output (None: no output).

    Raises ``ExecutionError`` on a deadlock, a race, an uninitialised read or a
    mismatched message.
    """
    run = _Run(program, [np.asarray(x).ravel() for x in inputs], fifo_slots, check_races)
    run.run(random.Random(seed))
    return run.outputs()


def random_inputs(program: Program, seed: int, chunk_elems: int = 4, dtype=np.float32) -> list[np.ndarray]:
    """Random flat inputs for every rank (integers, so float sums are exact in any order)."""
    rng = np.random.default_rng(seed)
    n = input_chunks(program) * chunk_elems
    return [rng.integers(-64, 64, size=n).astype(dtype) for _ in range(program.ngpus)]


def awaited_steps(program: Program) -> int:
    """How many steps some other step waits on (each keeps a vector clock when races are checked)."""
    return len({(g.id, *d) for g in program.gpus for tb in g.threadblocks for st in tb.steps for d in st.deps})


@dataclass
class CheckResult:
    seeds: int
    steps: int
    threadblocks: int
    races_checked: bool = True


def check_program(program: Program, seeds: int = 8, chunk_elems: int = 4, fifo_slots: int = 1) -> CheckResult:
    """Execute under ``seeds`` random interleavings and data; raise ``ExecutionError`` if any is wrong.

    Races are checked while the vector clocks fit ``RACE_CHECK_MAX_CLOCK_BYTES`` (``races_checked``)."""
    custom = custom_name(program) if program.collective == "custom" else ""
    nprocs = sum(len(g.threadblocks) for g in program.gpus)
    races = 8 * nprocs * (nprocs + awaited_steps(program)) <= RACE_CHECK_MAX_CLOCK_BYTES
    for seed in range(seeds):
        inputs = random_inputs(program, seed, chunk_elems)
        got = execute(program, inputs, seed=seed, fifo_slots=fifo_slots, check_races=races)
        want = reference_result(program.collective, inputs, custom)
        for r, (g, w) in enumerate(zip(got, want)):
            if w is None:
                continue
            if g is None or g.shape != w.shape or not np.allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=False):
                bad = "no output" if g is None else _first_bad_chunk(g, w, chunk_elems)
                raise ExecutionError("wrong result", f"gpu {r} output differs from the {program.collective} "
                                     f"result ({bad}) with seed {seed}")
    steps = sum(len(tb.steps) for g in program.gpus for tb in g.threadblocks)
    return CheckResult(seeds=seeds, steps=steps, threadblocks=nprocs, races_checked=races)


def _first_bad_chunk(got: np.ndarray, want: np.ndarray, chunk_elems: int) -> str:
    if got.shape != want.shape:
        return f"{got.size} elements instead of {want.size}"
    bad = np.flatnonzero(~np.isclose(got, want, rtol=1e-5, atol=1e-5))
    return f"first wrong chunk {bad[0] // chunk_elems} of the output"
