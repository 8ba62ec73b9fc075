"""Run plans on random data on every rank, check every destination tile exactly
against the source tensor before and after timing them (the measurement engine,
``calibrate.measure``); one line per plan on rank 0.

Beside the plans of each task, in the same comparison, a plain exchange of the same
tiles (``ExchangeArm``: every transfer posted at once, one NCCL group or MPI
Isend/Irecv + Waitall: the all-to-all / send-recv a user would write by hand), checked
the same way, and (a measurement, ``iters`` above 1) each plan's dry run (``DryArm``: the host's
walk of it, at the host's pace of the same rounds). After the plans, every distinct operation the
plans' executor runs (a transfer between two ranks, a broadcast over a chain, an all-gather over a
group, a copy, a fill: ``kernels.reshard.model``) is timed alone in one more
comparison, and each plan is predicted by simulating its operations on the ranks' streams with those
costs beside its host time (``predicted_exec_s``): the planner's makespan prices transfers under its
network model, this prices what the executor does, from measurements of its parts, never of the plan."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from calibrate.errors import UserError
from calibrate.measure.engine import Arm, ArmResult, MpiGroup, Options, TimingMode, compare
from kernels.reshard.model import Op, host_time, measured_cost, operations, predict
from kernels.reshard.plan import Plan
from kernels.reshard.program import BACKENDS, Backend, execute, legs
from kernels.reshard.spec import Box, box_volume, local_slices


def global_tensor(shape, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-1000, 1000, size=shape).astype(dtype)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


class PlanArm(Arm):
    """One plan as an arm of the measurement engine on this rank: a call executes it (``execute``
    synchronizes the backend's stream); the check runs it on a fresh random tensor into a
    poisoned destination tile and counts the elements that differ from the source tensor's."""

    def __init__(self, plan: Plan, be: Backend, seed: int):
        self.plan, self.be = plan, be
        self.src_box = plan.task.src_tiles().get(be.device)
        self.dst_box = plan.task.dst_tiles().get(be.device)
        be.prepare(plan)   # once, with its legs: a call is the plan's walk, as a user's loop runs it
        self.legs = legs(plan, be.device)
        self._fill(seed)

    def _fill(self, seed: int) -> np.ndarray:
        full = global_tensor(self.plan.task.shape, self.plan.task.dtype, seed)
        xp = self.be.xp
        self.src = xp.asarray(np.ascontiguousarray(full[_slices(self.src_box)])) if self.src_box else None
        self.dst = xp.zeros(tuple(hi - lo for lo, hi in self.dst_box), self.plan.task.dtype) if self.dst_box else None
        return full

    def call(self) -> None:
        execute(self.plan, self.be, self.src, self.dst, self.legs)

    def check(self, seed: int) -> int:
        full = self._fill(seed)
        if self.dst_box is None:
            self.call()
            return 0
        want = full[_slices(self.dst_box)]
        poison = np.iinfo(want.dtype).min if want.dtype.kind in "iu" else np.nan
        self.dst[...] = poison
        self.call()
        got = self.dst.get() if hasattr(self.dst, "get") else self.dst
        return int(np.count_nonzero(got != want))


class ExchangeArm(PlanArm):
    """The same tiles moved by a plain exchange, as a user would write it: each unit from its first holder to
    every receiver that does not hold it (a receiver that does copies its own, tile to tile), the slices worked
    out once; a call packs what it sends, posts every transfer of the rank at once (``Backend.exchange``), then
    places what it received."""

    def __init__(self, plan: Plan, be: Backend, seed: int):
        super().__init__(plan, be, seed)
        task, me = plan.task, be.device
        src_at, dst_at = task.src_tiles().get(me), task.dst_tiles().get(me)
        self.local, self.sends, self.recvs = [], [], []
        for u in sorted(plan.units, key=lambda u: u.index):
            for r in u.receivers:
                if r == me and me in u.senders:
                    self.local.append((local_slices(u.box, src_at), local_slices(u.box, dst_at)))
                elif r == me:
                    self.recvs.append((local_slices(u.box, dst_at), box_volume(u.box), u.senders[0]))
                elif u.senders[0] == me and r not in u.senders:
                    self.sends.append((local_slices(u.box, src_at), r))

    def call(self) -> None:
        be, xp, dtype = self.be, self.be.xp, np.dtype(self.plan.task.dtype)
        for s, d in self.local:
            self.dst[d] = self.src[s]
        got = [(d, xp.empty(n, dtype), peer) for d, n, peer in self.recvs]
        be.exchange([(xp.ascontiguousarray(self.src[s]).reshape(-1), peer) for s, peer in self.sends],
                    [(buf, peer) for _, buf, peer in got])
        for d, buf, _ in got:
            self.dst[d] = buf.reshape(self.dst[d].shape)
        be.synchronize()


class OpArm(Arm):
    """One operation of the executor (``kernels.reshard.model.Op``) alone, on the backend's primitives, then the
    synchronisation a call ends with; ``op`` None: the synchronisation alone (``empty``)."""

    TAG = 32002

    def __init__(self, op: Op | None, be: Backend, dtype: str):
        self.op, self.be, self.dtype = op, be, np.dtype(dtype)
        n = 0 if op is None else op.nbytes // self.dtype.itemsize
        mine = op is not None and (op.kind in ("copy", "fill") or be.device in op.ranks)
        self.a = be.xp.ones(n, self.dtype) if mine else None
        self.b = be.xp.zeros(n, self.dtype) if mine and op.kind == "copy" else None

    def call(self) -> None:
        if self.a is not None:
            self._issue()
        self.be.synchronize()

    def _issue(self) -> None:
        op, be = self.op, self.be
        if op.kind == "copy":
            self.b[...] = self.a
        elif op.kind == "fill":
            be.xp.zeros(self.a.size, self.dtype)
        elif op.kind == "p2p" and be.device == op.ranks[0]:
            be.send(self.a, op.ranks[1], self.TAG)
        elif op.kind == "p2p":
            be.recv(self.a, op.ranks[0], self.TAG)
        elif op.kind == "broadcast":
            be.ring_broadcast(self.a, op.ranks, op.partitions, self.TAG)
        else:
            be.allgather(self.a, op.ranks, self.a.size // len(op.ranks), self.TAG)


class DryArm(PlanArm):
    """A plan executed on a ``DryBackend`` (its transfers move nothing): what the host's walk of it costs, timed in
    the plan's own comparison so that the host's pace is the plan's; its backend also keeps each call's walk up
    to the synchronisation (``DryBackend.walks``). Its destination is not the plan's result, so there is nothing
    to check."""

    def __init__(self, plan: Plan, be: Backend, seed: int):
        super().__init__(plan, DryBackend(be), seed)

    def call(self) -> None:
        self.be.started = time.perf_counter()
        super().call()

    def check(self, seed: int) -> int:
        self.call()
        return 0


class DryExchangeArm(DryArm, ExchangeArm):
    """The plain exchange on a ``DryBackend``: its host's walk, beside the plans' (what tells a plan's gain or loss
    against it on the host from one on the GPU)."""


class DryBackend(Backend):
    """A backend whose transfers move nothing (the copies, fills and the synchronisation are the real
    backend's): a plan executed on it costs the host's walk of the plan, its copies and fills."""

    def __init__(self, be: Backend):
        self.be, self.device, self.xp = be, be.device, be.xp
        self.started = 0.0
        self.walks: list[float] = []   # each call's seconds from ``started`` to its synchronisation, by the host clock

    def _move_nothing(self, *args):
        pass

    send = recv = ring_broadcast = allgather = _move_nothing

    def group(self):
        return self.be.group()

    def synchronize(self):
        self.walks.append(time.perf_counter() - self.started)
        self.be.synchronize()


def primitive_times(plans: list[Plan], be: Backend, group, iters: int, seed: int) -> tuple[dict, float | None]:
    """Each distinct operation of ``plans`` (``Op.key``) timed alone (medians of the slowest rank) and the empty
    call's time (None: it did not run); an operation that did not run is absent."""
    ops = {op.key: op for plan in plans for op in operations(plan)}
    for plan in plans:
        be.prepare(plan)
    dtype = plans[0].task.dtype
    arms = [("empty", lambda: OpArm(None, be, dtype))]
    arms += [(repr(k), lambda op=op: OpArm(op, be, dtype)) for k, op in ops.items()]
    res = compare(group, arms, replace(_options(iters, seed), check=False))

    def median(name: str) -> float | None:
        return res[name].median_s if res[name].ok else None
    return {k: median(repr(k)) for k in ops if median(repr(k)) is not None}, median("empty")


def executor_predictions(rows: list[dict], plans: list[Plan], times: dict, empty: float | None,
                         dry: list[tuple[float, float] | None], asynchronous: bool) -> list[float]:
    """Each ok row's ``predicted_exec_s`` (its plan's operations simulated with the costs measured alone after the
    host's time from its dry run, ``kernels.reshard.model``; absent where one of them did not run), ``host_s``, and
    what they came from: the dry run and its walk up to the synchronisation (``dry``: ``dry_s``, ``walk_s``, the
    walk recorded for other models), the empty call and each operation, in the order issued, with its cost alone
    and its wave (``operations``: kind, ranks, bytes, seconds, wave); returns the rows' measured /
    predicted_exec."""
    ratios = []
    for row, plan, d in zip(rows, plans, dry):
        ops = operations(plan)
        if empty is None or d is None or not row.get("ok") or any(op.key not in times for op in ops):
            continue
        cost = measured_cost(times, empty)
        row.update(dry_s=d[0], walk_s=d[1], empty_s=empty,
                   operations=[[op.kind, list(op.ranks), op.nbytes, cost(op), op.wave] for op in ops])
        row["host_s"] = host_time(plan, cost, empty, d[0], asynchronous)
        row["predicted_exec_s"] = predict(plan, cost, empty, row["host_s"], asynchronous)
        ratios.append(row["measured_s"] / row["predicted_exec_s"])
    return ratios


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f}"


def check_ranks(plans: list[tuple[str, Plan]], size: int) -> None:
    """Every plan's devices are ranks of a communicator of ``size`` (device id = rank)."""
    for name, plan in plans:
        if plan.task.ranks_needed > size:
            raise UserError(f"{name} needs {plan.task.ranks_needed} ranks but {size} run: launch more")


def _options(iters: int, seed: int) -> Options:
    """``iters`` runs per plan, each alone after a barrier (one untimed run first when above 1),
    checked before and after."""
    return Options(TimingMode.ISOLATED, rounds=iters, calls=1, min_batch_s=0.0, warmup=1 if iters > 1 else 0,
                   seed=seed)


def run_plans(plans: list[tuple[str, Plan]], backend: str, comm, seed: int = 0, iters: int = 1) -> list[dict]:
    """Run each (name, plan) on every rank of ``comm`` with backend ``backend``: the plans of one name
    (one task: strategies and solvers) are the arms of one engine comparison (``calibrate.measure``),
    each run ``iters`` times alone after a barrier in interleaved rounds and checked exactly before
    and after, beside each plan's dry run when ``iters`` is above 1; each plan is then predicted by its
    executor's operations, each timed alone (``primitive_times``, ``executor_predictions``).
    On rank 0 prints a line per plan and returns the rows (measured: the median over runs of the slowest
    rank; None where the plan did not run right); [] elsewhere."""
    check_ranks(plans, comm.Get_size())
    be = BACKENDS.get(backend)(comm)
    group = MpiGroup(comm)
    rows, row_plans, dry = [], [], {}
    try:
        for name in dict.fromkeys(n for n, _ in plans):
            mine = [(i, plan) for i, (n, plan) in enumerate(plans) if n == name]
            arms = [(str(i), lambda plan=plan, i=i: PlanArm(plan, be, seed + i)) for i, plan in mine]
            arms.append(("exchange", lambda plan=mine[0][1]: ExchangeArm(plan, be, seed + len(plans))))
            drying: dict = {}
            if iters > 1:   # a measurement: each plan's dry run beside it, in the same rounds
                arms += [(f"dry {i}", lambda plan=plan, i=i: drying.setdefault(i, DryArm(plan, be, seed + i)))
                         for i, plan in mine]
                arms.append(("dry exchange", lambda plan=mine[0][1]: DryExchangeArm(plan, be, seed + len(plans))))
            res = compare(group, arms, _options(iters, seed + mine[0][0]))
            for i, _ in mine:   # (the dry run, its walk: this rank's median of the timed calls, the slowest rank's)
                walks = drying[i].be.walks[-iters:] if i in drying else []
                walk = comm.allreduce(float(np.median(walks)) if walks else -1.0, op=MPI.MAX)
                if iters > 1 and res[f"dry {i}"].ok and walk >= 0:
                    dry[i] = (res[f"dry {i}"].median_s, walk)
            if comm.Get_rank() == 0:
                base = res["exchange"]
                mine_rows = [_row(name, plan, backend, res[str(i)], base) for i, plan in mine]
                if iters > 1:
                    for r in mine_rows:
                        r["exchange_dry_s"] = res["dry exchange"].median_s
                rows += mine_rows
                row_plans += [plan for _, plan in mine]
                shown = "-" if base.median_s is None else f"{base.median_s * 1e3:8.3f}"
                print(f"{'OK ' if base.ok else 'BAD'} {name:28s} {'exchange (baseline)':28s} wrong="
                      f"{max(base.wrong_before, 0) + max(base.wrong_after, 0)} measured {shown} ms"
                      + (f" (its dry run {_ms(res['dry exchange'].median_s)} ms)" if iters > 1 else "")
                      + ("" if base.ok else f" ({base.reason})"), flush=True)
        if iters > 1:   # a measurement (warmed up, several runs): its parts measured beside it
            times, empty = primitive_times([p for _, p in plans], be, group, iters, seed + len(plans) + 1)
    finally:
        be.close()
    if rows and iters < 2:
        print("executor model: not measured (one run a plan, not warmed up: give --iters 2 or more)", flush=True)
    elif rows:
        index = {id(p): i for i, (_, p) in enumerate(plans)}
        ratios = executor_predictions(rows, row_plans, times, empty,
                                      [dry.get(index[id(p)]) for p in row_plans], be.asynchronous)
        print(f"executor model (each plan's operations on the ranks' streams and the host's walk of it, each "
              f"operation alone and each plan's dry run timed in this run: "
              f"{len(times)} operations, an empty call {_ms(empty)} ms):", flush=True)
        for r in rows:
            print(f"   {r['scenario']:28s} {r['strategy']:17s} makespan {_ms(r['predicted_s'])} ms, executor "
                  f"{_ms(r.get('predicted_exec_s'))} ms (host {_ms(r.get('host_s'))}), measured "
                  f"{_ms(r['measured_s'])} ms"
                  + (f" ({r['measured_s'] / r['predicted_exec_s']:.2f}x)" if r.get("predicted_exec_s") else ""),
                  flush=True)
        if ratios:
            inside = sum(abs(x - 1) <= 0.15 for x in ratios)
            print(f"measured / predicted (executor model) {min(ratios):.2f}..{max(ratios):.2f}: {inside} of "
                  f"{len(ratios)} plans within 15%", flush=True)
    return rows


def _row(name: str, plan: Plan, backend: str, arm: ArmResult, base: ArmResult | None = None) -> dict:
    tiles = len(plan.task.dst_tiles())
    wrong = max(arm.wrong_before, 0) + max(arm.wrong_after, 0)
    ok = arm.ok and tiles > 0
    measured = arm.median_s
    row = {"scenario": name, "strategy": plan.strategy, "solver": plan.solver, "backend": backend,
           "bytes": sum(u.nbytes for u in plan.units), "jobs": len(plan.jobs), "predicted_s": plan.makespan,
           "measured_s": measured, "wrong": wrong, "ok": ok}
    if base is not None:
        row["exchange_s"] = base.median_s
        row["exchange_ok"] = base.ok
        row["exchange_wrong"] = max(base.wrong_before, 0) + max(base.wrong_after, 0)
    if not arm.ok:
        row["reason"] = arm.reason
    shown = "-" if measured is None else f"{measured * 1e3:8.3f}"
    print(f"{'OK ' if ok else 'BAD'} {name:28s} {plan.strategy:17s} {plan.solver:10s} "
          f"jobs={len(plan.jobs):3d} K<={max(j.partitions for j in plan.jobs):<4d} tiles={tiles} "
          f"wrong={wrong} predicted {plan.makespan * 1e3:8.3f} ms measured {shown} ms"
          + ("" if arm.ok else f" ({arm.reason})"), flush=True)
    return row
