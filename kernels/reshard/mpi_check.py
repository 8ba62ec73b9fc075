"""Run resharding plans with the MPI backend and check every destination tile.

    mpiexec -n 8 python -m kernels.reshard.mpi_check --shape 12,10,6 --devices-per-host 2 \\
        --scenario S0RR@2,2:S0RR@2,2 --scenario RS01R@2,2:S01RR@2,2 ...

Device id = MPI rank. Rank 0 plans (every strategy x the listed solvers) and
broadcasts the plans; all ranks execute them on random data; rank 0 prints one
line per plan and exits 1 if any element is wrong.
"""
from __future__ import annotations

import sys
from pathlib import Path

from mpi4py import MPI

from autotune.reshard.plan import Plan, make_plan
from autotune.reshard.solvers import SOLVERS, SolverConfig
from autotune.reshard.strategies import STRATEGIES
from calibrate.cli import command_parser
from calibrate.errors import UserError
from calibrate.profile import Profile
from kernels.reshard.harness import parse_scenario, run_and_check
from kernels.reshard.mpi_backend import MPIBackend


def _fits(task, what: str, size: int) -> None:
    used = max(task.src_mesh.devices + task.dst_mesh.devices) + 1
    if used > size:
        raise UserError(f"{what} needs {used} ranks but {size} run: launch more")


def main(argv=None) -> int:
    p = command_parser("python -m kernels.reshard.mpi_check", __doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", default=[],
                   help="SRCSPEC@H,D[devices]:DSTSPEC@H,D[devices][+shared]; repeat for several")
    p.add_argument("--plan", action="append", default=[],
                   help="a plan file from python -m autotune reshard --plan-out; repeat for several")
    p.add_argument("--shape", default="12,10,6")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--devices-per-host", type=int, default=2)
    p.add_argument("--solvers", default="naive,ensemble", help="comma-separated solvers")
    p.add_argument("--profile", default="aws-p3-v100")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    shape = tuple(int(x) for x in args.shape.split(","))
    plans, error = [], None
    if rank == 0:
        try:
            if not args.scenario and not args.plan:
                raise UserError("nothing to run: give --scenario or --plan")
            for path in args.plan:
                plan = Plan.load(path)
                _fits(plan.task, path, comm.Get_size())
                plans.append((Path(path).name, plan))
            prof = Profile.load(args.profile)
            for sol in args.solvers.split(","):
                if sol not in SOLVERS:
                    raise UserError(f"unknown solver {sol!r}: choose from {', '.join(SOLVERS)}")
            for sc in args.scenario:
                task = parse_scenario(sc, shape, args.dtype, args.devices_per_host)
                _fits(task, sc, comm.Get_size())
                for st in STRATEGIES:
                    for sol in args.solvers.split(","):
                        plans.append((sc, make_plan(task, prof, st, sol, SolverConfig(time_budget=0.05, rounds=4))))
        except UserError as e:
            error = str(e)
    plans, error = comm.bcast((plans, error), root=0)
    if error:
        if rank == 0:
            print(f"mpi_check: error: {error}", file=sys.stderr)
        return 2
    be = MPIBackend(comm)
    bad = 0
    for i, (sc, plan) in enumerate(plans):
        out = run_and_check(plan, be, seed=args.seed + i, barrier=comm.Barrier)
        outs = comm.gather(out, root=0)
        if rank == 0:
            checked = [o for o in outs if o.checked]
            wrong = sum(o.mismatches for o in checked)
            bad += wrong > 0 or not checked
            secs = max(max(o.seconds) for o in outs)
            print(f"{'OK ' if wrong == 0 and checked else 'BAD'} {sc:28s} {plan.strategy:17s} {plan.solver:10s} "
                  f"jobs={len(plan.jobs):3d} K<={max(j.partitions for j in plan.jobs):<4d} tiles={len(checked)} wrong={wrong} {secs * 1e3:.1f} ms", flush=True)
    bad = comm.bcast(bad, root=0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
