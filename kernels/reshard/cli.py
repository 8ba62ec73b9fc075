"""``python -m kernels reshard PLAN.json...``: run resharding plans on every rank
(under mpiexec or mpirun, device id = rank) and check every destination tile.

    mpiexec -n 6 python -m kernels reshard plan.json [--backend nccl] [--iters 5] [--results out.json]

Prints one line per plan (OK or BAD, predicted and measured time); exits 1 if
any element is wrong. Plans come from ``python -m autotune reshard --plan-out``.
"""
from __future__ import annotations

import sys
from pathlib import Path

from calibrate.cli import command_parser, run_on_ranks
from kernels.reshard.harness import run_plans
from kernels.reshard.plan import Plan
from kernels.reshard.program import BACKENDS


def parser():
    p = command_parser("python -m kernels reshard", __doc__.split("\n\n")[0])
    p.add_argument("plans", nargs="+", help="plan files written by python -m autotune reshard --plan-out")
    p.add_argument("--backend", default="mpi", choices=list(BACKENDS), help="mpi (host buffers) or nccl (GPUs)")
    p.add_argument("--iters", type=int, default=1, help="timed runs per plan, after one untimed run when above 1")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tensor")
    p.add_argument("--results", help="write the rows as a resharding results JSON (kind 'reshard')")
    return p


def main(argv=None) -> int:
    from mpi4py import MPI

    args = parser().parse_args(argv)
    comm = MPI.COMM_WORLD
    plans = run_on_ranks(comm, lambda: [(Path(p).name, Plan.load(p)) for p in args.plans], "kernels reshard")
    if plans is None:
        return 2
    return execute_and_report(plans, args, comm, "kernels reshard")


def execute_and_report(plans, args, comm, prog: str, profile: str = "") -> int:
    """Run the plans (``run_plans``), write ``--results`` on rank 0; 1 if any is wrong, 2 on a user error."""
    from kernels.reshard.results import ReshardResults

    rows = run_on_ranks(comm, lambda: run_plans(plans, args.backend, comm, args.seed, args.iters), prog,
                        collective=True)
    if rows is None:
        return 2
    bad = comm.bcast(sum(not r["ok"] for r in rows), root=0)
    if args.results and comm.Get_rank() == 0:
        path = ReshardResults(profile or plans[0][1].profile, executed=rows).save(args.results)
        print(f"results written to {path}", file=sys.stderr)
    return 1 if bad else 0
