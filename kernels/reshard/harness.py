"""Run a plan on random data and check every destination tile exactly; time it."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from autotune.reshard.cases import build_task
from autotune.reshard.plan import Plan
from autotune.reshard.spec import Box, parse_mesh_shape
from calibrate.errors import UserError
from kernels.reshard.program import Backend, execute


@dataclass
class Outcome:
    device: int
    checked: bool        # this device had a destination tile to check
    mismatches: int      # elements that differ from the source tensor
    seconds: list[float]


def parse_scenario(text: str, shape, dtype: str, devices_per_host: int):
    """``SRCSPEC@H,D:DSTSPEC@H,D`` with an optional ``+shared`` (destination on the source devices)."""
    shared = text.endswith("+shared")
    body = text[:-len("+shared")] if shared else text
    try:
        src, dst = body.split(":")
        (sspec, smesh), (dspec, dmesh) = src.split("@"), dst.split("@")
    except ValueError:
        raise UserError(f"scenario {text!r} is not SRCSPEC@H,D:DSTSPEC@H,D[+shared], e.g. S0RR@2,2:RRR@2,2") from None
    return build_task(parse_mesh_shape(smesh), sspec, parse_mesh_shape(dmesh), dspec, tuple(shape), dtype,
                      devices_per_host, shared=shared)


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
