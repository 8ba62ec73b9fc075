"""Run plans on random data on every rank, check every destination tile exactly
against the source tensor before and after timing them (the measurement engine,
``calibrate.measure``); one line per plan on rank 0."""
from __future__ import annotations

import numpy as np

from calibrate.errors import UserError
from calibrate.measure.engine import Arm, ArmResult, MpiGroup, Options, TimingMode, compare
from kernels.reshard.plan import Plan
from kernels.reshard.program import BACKENDS, Backend, execute
from kernels.reshard.spec import Box


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
            res = compare(group, arms, _options(iters, seed + mine[0][0]))
            if comm.Get_rank() == 0:
                rows += [_row(name, plan, backend, res[str(i)]) for i, plan in mine]
    finally:
        be.close()
    return rows


def _row(name: str, plan: Plan, backend: str, arm: ArmResult) -> dict:
    tiles = len(plan.task.dst_tiles())
    wrong = max(arm.wrong_before, 0) + max(arm.wrong_after, 0)
    ok = arm.ok and tiles > 0
    measured = arm.median_s
    row = {"scenario": name, "strategy": plan.strategy, "solver": plan.solver, "backend": backend,
           "bytes": sum(u.nbytes for u in plan.units), "jobs": len(plan.jobs), "predicted_s": plan.makespan,
           "measured_s": measured, "wrong": wrong, "ok": ok}
    if not arm.ok:
        row["reason"] = arm.reason
    shown = "-" if measured is None else f"{measured * 1e3:8.3f}"
    print(f"{'OK ' if ok else 'BAD'} {name:28s} {plan.strategy:17s} {plan.solver:10s} "
          f"jobs={len(plan.jobs):3d} K<={max(j.partitions for j in plan.jobs):<4d} tiles={tiles} "
          f"wrong={wrong} predicted {plan.makespan * 1e3:8.3f} ms measured {shown} ms"
          + ("" if arm.ok else f" ({arm.reason})"), flush=True)
    return row
