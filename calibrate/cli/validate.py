"""``python -m calibrate validate --profile P <results dirs...>``: a profile's
prediction next to each measurement, with the error, and a summary per
collective and tier (e.g. a 2-GPU profile judged on 4- and 8-GPU runs).

``--random N --seed S`` (one process per GPU or rank, under mpiexec or srun)
first measures N sizes per collective drawn at random: log-uniform between
--min-bytes and --max-bytes, each a multiple of --align bytes per rank (so
neither on the sweep's grid nor used by any fit), timed as ``calibrate run``
times (the profile's timing mode unless --mode says otherwise), written to a
results directory of their own, and then judges the profile on them. Measured
in a process of their own, after the sweep's, they are not timed under the
sweep's conditions; ``calibrate run --random N`` measures them in the sweep's
run, each in turn with the sweep's sizes (what tests/gpu/calib_check.sh does).
"""
from __future__ import annotations

import datetime as _dt
import os
import sys

import numpy as np
import pandas as pd

from calibrate.cli import add_timing_args, command_parser, seed_int
from calibrate.collectives import Collective
from calibrate.errors import UserError
from calibrate.profile import DEFAULT_PROFILE, Profile
from calibrate.results import load_results
from calibrate.sizes import parse_size
from calibrate.measure.heldout import random_sizes
from calibrate.validation import compare, fairness_warnings, summarize


def build_parser():
    p = command_parser("python -m calibrate validate",
                       "Compare a profile's predictions with calibration measurements, "
                       "or measure sizes drawn at random (--random) and compare.")
    p.add_argument("results", nargs="*", help="results directories written by python -m calibrate run")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"profile name or JSON file. Default {DEFAULT_PROFILE}")
    p.add_argument("--summary-only", action="store_true", help="print only the summary")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="measure N sizes per collective drawn at random, then compare (under mpiexec or srun)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random sizes. Default 0")
    p.add_argument("--align", default="256", help="random sizes are multiples of this many bytes per rank. "
                                                  "Default 256")
    p.add_argument("--check", action="store_true", help="with --random: check each size on fresh random data after "
                   "timing it, as calibrate run --check does in the sweep that the profile was fitted on")
    add_timing_args(p, mode_default=None, min_default=None)
    return p


def report(profile: Profile, stats: pd.DataFrame, min_bytes: int, summary_only: bool) -> int:
    table = compare(profile, stats, min_bytes)
    if table.empty:
        raise UserError(f"no measurement at or above {min_bytes} B to judge: lower --min-bytes")
    fmt = lambda v: f"{v:.2f}"  # noqa: E731
    if not summary_only:
        print(table.to_string(index=False, float_format=fmt))
        print()
    print(f"# profile {profile.name!r} ({profile.provenance.get('kind')}) against the measurements")
    print(summarize(table).to_string(index=False, float_format=fmt))
    return 0 if np.isfinite(table["error_%"]).all() else 1


def warn(lines: list[str]) -> None:
    for line in lines:
        print(f"warning: {line}", file=sys.stderr)


def default_max_bytes(profile: Profile, backend: str) -> str:
    """The largest random size unless --max-bytes says: the backend's default (1G with nccl, 64M with mpi),
    and no larger than the largest size the profile was fitted on (beyond it, nothing is measured to judge)."""
    cap = (1 << 30) if backend == "nccl" else (64 << 20)
    top = max((pt[0] for tier in profile.tiers.values() for by_p in tier.values() for m in by_p.values()
               for pt in m.points), default=0)
    return str(int(min(cap, top)) if top else cap)


def measure_random(args) -> int:
    """Measure the random sizes under MPI (every rank), then judge the profile on rank 0."""
    from mpi4py import MPI

    from calibrate.cli import run_mpi_command
    from calibrate.cli.run import INTERRUPTED, pick_backend, run

    world = MPI.COMM_WORLD

    def body() -> int:
        profile = Profile.load(args.profile)
        colls = [Collective.parse(c) for c in args.collectives.split(",") if c.strip()]
        args.mode = args.mode or profile.timing_mode or "host"
        lo = parse_size(args.min_bytes or "1K")
        hi = parse_size(args.max_bytes or default_max_bytes(profile, pick_backend(args.backend)))
        sizes = random_sizes(colls, lo, hi, args.random, args.seed, parse_size(args.align) * world.Get_size())
        args.out = args.out or os.path.join("results", "validate-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
        args.refine = False
        rc = run(args, world, random_sizes=sizes)
        if world.Get_rank() == 0:
            runs = load_results([args.out])
            warn(fairness_warnings(profile, runs))
            stats = pd.concat([st for _, st in runs], ignore_index=True)
            print(f"# {args.random} random sizes per collective (seed {args.seed}) measured into {args.out}")
            rc = max(rc, report(profile, stats, 0, args.summary_only))
        return rc

    return run_mpi_command(body, world, "calibrate validate", INTERRUPTED)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.random:
        if args.results:
            raise UserError("--random measures its own sizes: give no results directories with it")
        return measure_random(args)
    profile = Profile.load(args.profile)
    if not args.results:
        raise UserError("give results directories to judge the profile on, or --random N to measure sizes")
    runs = load_results(args.results)
    warn(fairness_warnings(profile, runs))
    stats = pd.concat([st for _, st in runs], ignore_index=True)
    return report(profile, stats, parse_size(args.min_bytes) if args.min_bytes else 0, args.summary_only)
