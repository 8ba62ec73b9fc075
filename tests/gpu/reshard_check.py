"""GPU check of the cross-mesh resharding executor (NCCL backend), one process per GPU.

    NCCL_NVLS_ENABLE=0 mpirun --allow-run-as-root -np 2 python tests/gpu/reshard_check.py [OUTDIR] \\
        [--profile P] [--mib 256] [--iters 5]

Runs what two GPUs on one host allow: device 0 -> device 1 (meshes (1,1) ->
(1,1)) and same-device reshards of (1,2) meshes, every strategy, planned with
the ensemble solver on the profile (default ``calibrate.profile.DEFAULT_PROFILE``).
Checks every destination tile exactly against the source tensor; reports the
measured time (median of --iters runs after one warm-up) next to the plan's
predicted makespan. Writes OUTDIR/reshard_gpu.json (OUTDIR: argv or env OUT,
default .). Exit status 1 if any element is wrong.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from mpi4py import MPI

from autotune.reshard.plan import make_plan
from autotune.reshard.solvers import SolverConfig
from autotune.reshard.strategies import STRATEGIES
from calibrate import profile as profiles
from calibrate.errors import UserError
from kernels.reshard.harness import parse_scenario, run_and_check
from kernels.reshard.nccl_backend import NCCLBackend

SCENARIOS = [
    "RRR@1,1[0]:RRR@1,1[1]",      # device 0 -> device 1, the whole tensor
    "S1RR@1,2:S1RR@1,2[1,0]",     # the two halves swap devices
    "S1RR@1,2:RS1R@1,2+shared",   # each device keeps a quarter, swaps a quarter
    "S1RR@1,2:RRR@1,2+shared",    # all-gather-like: each device needs the other's half
    "RRR@1,1[1]:RRR@1,2[0,1]",    # device 1 -> devices 0 and 1 (a broadcast)
    "RRR@1,1[0]:S1RR@1,2[0,1]",   # device 0 scatters halves to devices 0 and 1
]


def main(argv=None) -> int:
    try:
        return check(argv)
    except UserError as e:
        print(f"reshard_check: error: {e}", file=sys.stderr)
        return 2


def check(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=os.environ.get("OUT", "."))
    p.add_argument("--profile", default=profiles.DEFAULT_PROFILE)
    p.add_argument("--mib", type=int, default=256, help="tensor size in MiB (float32)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--scenario", action="append", default=None,
                   help="SRCSPEC@H,D[devices]:DSTSPEC@H,D[devices][+shared]; repeat for several "
                        "(default: the 2-GPU scenarios above)")
    p.add_argument("--devices-per-host", type=int, default=None,
                   help="GPUs per host of the meshes (default: the number of ranks)")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    scenarios = args.scenario or SCENARIOS
    per_host = args.devices_per_host or comm.Get_size()
    if not args.scenario and comm.Get_size() != 2:
        if rank == 0:
            print("reshard_check: the default scenarios need mpirun -np 2 (one process per GPU); "
                  "give --scenario for other counts", file=sys.stderr)
        return 2
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        if rank == 0:
            print("reshard_check: set NCCL_NVLS_ENABLE=0", file=sys.stderr)
        return 2
    prof = profiles.Profile.load(args.profile)
    rows_per = args.mib * 2**20 // 4 // (1024 * 256)
    shape = (max(rows_per, 2), 1024, 256)
    be = NCCLBackend(comm)
    rows, bad = [], 0
    seed = 0
    for sc in scenarios:
        task = parse_scenario(sc, shape, "float32", per_host)
        for st in STRATEGIES:
            seed += 1
            plan = make_plan(task, prof, st, "ensemble", SolverConfig(time_budget=0.2))
            plan = comm.bcast(plan if rank == 0 else None, root=0)
            out = run_and_check(plan, be, seed=seed, iters=args.iters + 1, barrier=comm.Barrier)
            outs = comm.gather(out, root=0)
            if rank == 0:
                wrong = sum(o.mismatches for o in outs)
                measured = statistics.median(max(o.seconds[i] for o in outs) for i in range(1, args.iters + 1))
                bad += wrong > 0
                rows.append({"scenario": sc, "strategy": st, "bytes": sum(u.nbytes for u in plan.units),
                             "jobs": len(plan.jobs), "predicted_s": plan.makespan, "measured_s": measured,
                             "wrong": wrong})
                print(f"{'OK ' if wrong == 0 else 'BAD'} {sc:28s} {st:17s} jobs={len(plan.jobs):2d} "
                      f"predicted {plan.makespan * 1e3:8.3f} ms  measured {measured * 1e3:8.3f} ms  "
                      f"ratio {measured / plan.makespan if plan.makespan else float('nan'):6.2f}", flush=True)
    be.close()
    if rank == 0:
        path = Path(args.out) / "reshard_gpu.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kind": "reshard", "version": 1, "profile": prof.name, "cases": [],
                                    "pipelines": [], "gpu": rows}, indent=1) + "\n")
        print(f"wrote {path}")
    return 1 if comm.bcast(bad, root=0) else 0


if __name__ == "__main__":
    sys.exit(main())
