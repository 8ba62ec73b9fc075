"""Run plans on random data on every rank, check every destination tile exactly
against the source tensor, time them; one line per plan on rank 0."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from calibrate.errors import UserError
from kernels.reshard.plan import Plan
from kernels.reshard.program import BACKENDS, Backend, execute
from kernels.reshard.spec import Box


@dataclass
class Outcome:
    device: int
    checked: bool        # this device had a destination tile to check
    mismatches: int      # elements that differ from the source tensor
    seconds: list[float]


def global_tensor(shape, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-1000, 1000, size=shape).astype(dtype)


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def run_and_check(plan: Plan, be: Backend, seed: int = 0, iters: int = 1, barrier=None) -> Outcome:
    """Execute ``plan`` ``iters`` times on this rank; compare its destination tile to the truth."""
    full = global_tensor(plan.task.shape, plan.task.dtype, seed)
    me = be.device
    src_box = plan.task.src_tiles().get(me)
    dst_box = plan.task.dst_tiles().get(me)
    xp = be.xp
    src = xp.asarray(np.ascontiguousarray(full[_slices(src_box)])) if src_box else None
    times = []
    dst = None
    for _ in range(max(iters, 1)):
        dst = xp.zeros(tuple(hi - lo for lo, hi in dst_box), plan.task.dtype) if dst_box else None
        if barrier:
            barrier()
        t0 = time.perf_counter()
        execute(plan, be, src, dst)
        times.append(time.perf_counter() - t0)
    if dst_box is None:
        return Outcome(me, False, 0, times)
    got = dst.get() if hasattr(dst, "get") else dst
    want = full[_slices(dst_box)]
    return Outcome(me, True, int(np.count_nonzero(got != want)), times)


def check_ranks(plans: list[tuple[str, Plan]], size: int) -> None:
    """Every plan's devices are ranks of a communicator of ``size`` (device id = rank)."""
    for name, plan in plans:
        if plan.task.ranks_needed > size:
            raise UserError(f"{name} needs {plan.task.ranks_needed} ranks but {size} run: launch more")


def run_plans(plans: list[tuple[str, Plan]], backend: str, comm, seed: int = 0, iters: int = 1) -> list[dict]:
    """Run each (name, plan) on every rank of ``comm`` with backend ``backend``: one untimed run
    when ``iters`` > 1, then ``iters`` timed runs, checked. On rank 0 prints a line per plan
    and returns the rows (measured: the median over runs of the slowest rank); [] elsewhere."""
    check_ranks(plans, comm.Get_size())
    be = BACKENDS.get(backend)(comm)
    warm = 1 if iters > 1 else 0
    rows = []
    try:
        for i, (name, plan) in enumerate(plans):
            outs = comm.gather(run_and_check(plan, be, seed=seed + i, iters=iters + warm, barrier=comm.Barrier),
                               root=0)
            if comm.Get_rank() != 0:
                continue
            checked = [o for o in outs if o.checked]
            wrong = sum(o.mismatches for o in checked)
            measured = statistics.median(max(o.seconds[k] for o in outs) for k in range(warm, iters + warm))
            ok = wrong == 0 and bool(checked)
            rows.append({"scenario": name, "strategy": plan.strategy, "solver": plan.solver, "backend": backend,
                         "bytes": sum(u.nbytes for u in plan.units), "jobs": len(plan.jobs),
                         "predicted_s": plan.makespan, "measured_s": measured, "wrong": wrong, "ok": ok})
            print(f"{'OK ' if ok else 'BAD'} {name:28s} {plan.strategy:17s} {plan.solver:10s} "
                  f"jobs={len(plan.jobs):3d} K<={max(j.partitions for j in plan.jobs):<4d} tiles={len(checked)} "
                  f"wrong={wrong} predicted {plan.makespan * 1e3:8.3f} ms measured {measured * 1e3:8.3f} ms",
                  flush=True)
    finally:
        be.close()
    return rows
