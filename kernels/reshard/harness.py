"""Run a plan on random data and check every destination tile exactly; time it."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from autotune.reshard.plan import Plan
from autotune.reshard.spec import Box, Mesh, ShardingSpec, parse_mesh_shape
from autotune.reshard.tasks import ReshardTask
from calibrate.errors import UserError
from kernels.reshard.program import Backend, execute


@dataclass
class Outcome:
    device: int
    checked: bool        # this device had a destination tile to check
    mismatches: int      # elements that differ from the source tensor
    seconds: list[float]


def _side(text: str, devices_per_host: int, first_host: int) -> tuple[str, Mesh]:
    """``SPEC@H,D`` (placed from ``first_host``) or ``SPEC@H,D[d0,d1,...]`` (explicit device ids)."""
    spec, mesh = text.split("@")
    if "[" in mesh:
        shape, devs = mesh.rstrip("]").split("[")
        devices = tuple(int(d) for d in devs.split(",") if d.strip())
        return spec, Mesh(parse_mesh_shape(shape), devices, devices_per_host)
    return spec, Mesh.place(parse_mesh_shape(mesh), first_host, devices_per_host)


def parse_scenario(text: str, shape, dtype: str, devices_per_host: int) -> ReshardTask:
    """``SRCSPEC@H,D:DSTSPEC@H,D``: the destination on the hosts after the source, or on the source's
    devices with ``+shared``; either side may list its devices, ``SPEC@H,D[d0,d1,...]``."""
    shared = text.endswith("+shared")
    body = text[:-len("+shared")] if shared else text
    try:
        src, dst = body.split(":")
        sspec, smesh = _side(src, devices_per_host, 0)
        dspec, dmesh = _side(dst, devices_per_host, 0 if shared else smesh.shape[0])
    except ValueError:
        raise UserError(f"scenario {text!r} is not SRCSPEC@H,D[devices]:DSTSPEC@H,D[devices][+shared], "
                        f"e.g. S0RR@2,2:RRR@2,2") from None
    return ReshardTask(tuple(shape), dtype, smesh, ShardingSpec.parse(sspec), dmesh, ShardingSpec.parse(dspec))


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
