"""Run plans on random data on every rank, check every destination tile exactly
against the source tensor before and after timing them (the measurement engine,
``calibrate.measure``); one line per plan on rank 0.

Beside the plans of each task, in the same comparison, a plain exchange of the same
tiles (``ExchangeArm``: every transfer posted at once, one NCCL group or MPI
Isend/Irecv + Waitall: the all-to-all / send-recv a user would write by hand), checked
the same way. The executor's own costs, which the planner's alpha-beta makespan does not
charge (a fixed cost per call, a launch per job with the tile's pack and unpack copies,
a cost per NCCL group the rank runs collectives on), are fitted by non-negative least
squares on the other tasks' plans of the run (leave one task out: a plan is never
predicted from its own measurement) and added to each plan's makespan
(``executor_model``)."""
from __future__ import annotations

import numpy as np

from calibrate.errors import UserError
from calibrate.measure.engine import Arm, ArmResult, MpiGroup, Options, TimingMode, compare
from kernels.reshard.plan import Plan
from kernels.reshard.program import BACKENDS, Backend, _flat, _place, execute
from kernels.reshard.spec import Box
from kernels.reshard.strategies import groups


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
        self._fill(seed)

    def _fill(self, seed: int) -> np.ndarray:
        full = global_tensor(self.plan.task.shape, self.plan.task.dtype, seed)
        xp = self.be.xp
        self.src = xp.asarray(np.ascontiguousarray(full[_slices(self.src_box)])) if self.src_box else None
        self.dst = xp.zeros(tuple(hi - lo for lo, hi in self.dst_box), self.plan.task.dtype) if self.dst_box else None
        return full

    def call(self) -> None:
        execute(self.plan, self.be, self.src, self.dst)

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
    """The same tiles moved by a plain exchange: each unit from its first holder to every receiver that
    does not hold it (a receiver that does copies its own), every transfer of the rank posted at once
    (``Backend.exchange``), then placed."""

    def call(self) -> None:
        be, task = self.be, self.plan.task
        me, dtype = be.device, np.dtype(task.dtype)
        src_at, dst_at = task.src_tiles().get(me), task.dst_tiles().get(me)
        sends, recvs, local = [], [], []
        for u in sorted(self.plan.units, key=lambda u: u.index):
            n = int(np.prod([hi - lo for lo, hi in u.box]))
            for r in u.receivers:
                if r == me and me in u.senders:
                    local.append((u, _flat(be.xp, self.src, u.box, src_at), n))
                elif r == me:
                    recvs.append((u, be.xp.empty(n, dtype), u.senders[0], n))
                elif u.senders[0] == me and r not in u.senders:
                    sends.append((_flat(be.xp, self.src, u.box, src_at), r))
        be.exchange(sends, [(buf, peer) for _, buf, peer, _ in recvs])
        for u, buf, n in local:
            _place(self.dst, u.box, dst_at, buf, n)
        for u, buf, _, n in recvs:
            _place(self.dst, u.box, dst_at, buf, n)
        be.synchronize()


def job_load(plan: Plan) -> tuple[int, int]:
    """(jobs, groups) of the plan's busiest device: the jobs it takes part in and the NCCL groups
    (broadcast chains, all-gather groups) it runs collectives on."""
    devices = {d for j in plan.jobs for d in (j.sender, *j.receivers)}
    gs = [g for g in groups(plan) if len(g) > 1]
    return max(((sum(d == j.sender or d in j.receivers for j in plan.jobs), sum(d in g for g in gs))
                for d in devices), default=(0, 0))


EXEC_TERMS = ("call_s", "job_s", "group_s")


def _terms(rows: list[dict]) -> np.ndarray:
    from scipy.optimize import nnls

    a = np.array([[1.0, r["jobs_busiest"], r["groups_busiest"]] for r in rows])
    y = np.array([r["measured_s"] - r["predicted_s"] for r in rows])
    return nnls(a, y)[0]


def executor_model(rows: list[dict]) -> dict:
    """Each ok row's ``predicted_exec_s``: its makespan plus the executor's terms (``EXEC_TERMS``) fitted
    on the rows of the other scenarios (None where there is no other); returns the terms fitted on
    every ok row, and the rows' measured / predicted_exec range."""
    ok = [r for r in rows if r.get("ok") and r.get("measured_s") is not None]
    for r in ok:
        others = [o for o in ok if o["scenario"] != r["scenario"]]
        if others:
            c = _terms(others)
            r["predicted_exec_s"] = r["predicted_s"] + c[0] + c[1] * r["jobs_busiest"] + c[2] * r["groups_busiest"]
    ratios = [r["measured_s"] / r["predicted_exec_s"] for r in ok if r.get("predicted_exec_s")]
    return {"terms": dict(zip(EXEC_TERMS, map(float, _terms(ok)))) if ok else {},
            "measured_over_predicted": [min(ratios), max(ratios)] if ratios else []}


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
    and after. On rank 0 prints a line per plan and returns the rows (measured: the median over runs
    of the slowest rank; None where the plan did not run right); [] elsewhere."""
    check_ranks(plans, comm.Get_size())
    be = BACKENDS.get(backend)(comm)
    group = MpiGroup(comm)
    rows = []
    try:
        for name in dict.fromkeys(n for n, _ in plans):
            mine = [(i, plan) for i, (n, plan) in enumerate(plans) if n == name]
            arms = [(str(i), lambda plan=plan, i=i: PlanArm(plan, be, seed + i)) for i, plan in mine]
            arms.append(("exchange", lambda plan=mine[0][1]: ExchangeArm(plan, be, seed + len(plans))))
            res = compare(group, arms, _options(iters, seed + mine[0][0]))
            if comm.Get_rank() == 0:
                base = res["exchange"]
                mine_rows = [_row(name, plan, backend, res[str(i)], base) for i, plan in mine]
                rows += mine_rows
                shown = "-" if base.median_s is None else f"{base.median_s * 1e3:8.3f}"
                print(f"{'OK ' if base.ok else 'BAD'} {name:28s} {'exchange (baseline)':28s} wrong="
                      f"{max(base.wrong_before, 0) + max(base.wrong_after, 0)} measured {shown} ms"
                      + ("" if base.ok else f" ({base.reason})"), flush=True)
    finally:
        be.close()
    if rows:
        model = executor_model(rows)
        t = model["terms"]
        if t:
            print(f"executor terms (non-negative least squares on measured - makespan): call {t['call_s'] * 1e6:.1f} "
                  f"us, per job {t['job_s'] * 1e6:.1f} us, per NCCL group {t['group_s'] * 1e6:.1f} us; each plan "
                  f"predicted with the terms of the other scenarios: measured / predicted "
                  + ("-" if not model["measured_over_predicted"] else
                     "{:.2f}..{:.2f}".format(*model["measured_over_predicted"])), flush=True)
    return rows


def _row(name: str, plan: Plan, backend: str, arm: ArmResult, base: ArmResult | None = None) -> dict:
    tiles = len(plan.task.dst_tiles())
    wrong = max(arm.wrong_before, 0) + max(arm.wrong_after, 0)
    ok = arm.ok and tiles > 0
    measured = arm.median_s
    jobs, grps = job_load(plan)
    row = {"scenario": name, "strategy": plan.strategy, "solver": plan.solver, "backend": backend,
           "bytes": sum(u.nbytes for u in plan.units), "jobs": len(plan.jobs), "predicted_s": plan.makespan,
           "measured_s": measured, "wrong": wrong, "ok": ok, "jobs_busiest": jobs, "groups_busiest": grps}
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
