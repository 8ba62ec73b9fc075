"""``python -m calibrate health --profile P``: find the slow link or node. Under
mpiexec or srun, the same number of ranks on every node:

    srun --mpi=pmi2 python -m calibrate health --profile results/x/profile.json --out health.json

Times every rank (a ring within its node), every node pair (all of a node's
ranks exchanging with the other node's at once) and, on clusters too large for
every pair, a halving search over the nodes; prints each next to the profile's
expected time and its fraction of the profile's bandwidth, names the pairs,
nodes and ranks to suspect, and writes a ``commtune.health`` record (shown as a
heat map by ``python -m reports``). Exit 0 when nothing is slow, 1 when
something is suspect, 2 on bad input.
"""
from __future__ import annotations

import sys

from mpi4py import MPI

from calibrate.cli import command_parser, run_mpi_command, spelled_by
from calibrate.health import SEARCHES, HealthConfig, Timed, measure
from calibrate.outputs import check_output_path
from calibrate.profile import DEFAULT_PROFILE, Profile
from calibrate.sizes import format_size, parse_size


def build_parser():
    p = command_parser("python -m calibrate health", __doc__)
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="profile name or JSON file with an intra and an inter "
                   f"tier (python -m calibrate fit). Default {DEFAULT_PROFILE}")
    p.add_argument("-b", "--bytes", dest="nbytes", default="4M", help="bytes each rank sends per exchange. Default 4M")
    p.add_argument("-n", "--iters", type=int, default=5, help="timed exchanges per item (median). Default 5")
    p.add_argument("-w", "--warmup", type=int, default=1, help="untimed exchanges first. Default 1")
    p.add_argument("--slow", type=float, default=1.5, help="an item is an outlier above this many times the typical "
                   "time (the median of its kind). Default 1.5")
    p.add_argument("--search", default="auto", choices=SEARCHES, help="pairs: every node pair; halving: the halving "
                   "search; auto: pairs up to --max-pair-nodes nodes, halving above. Default auto")
    p.add_argument("--max-pair-nodes", type=int, default=16, help="most nodes timed pair by pair (auto). Default 16")
    p.add_argument("-o", "--out", default=None, help="health record JSON to write. Default: none")
    return p


def _table(title: str, items: list[Timed]) -> None:
    if not items:
        return
    w = max(len(t.name) for t in items)
    print(f"# {title}")
    print(f"{'name'.ljust(w)}  measured ms  expected ms  fraction  slow")
    for t in items:
        print(f"{t.name.ljust(w)}  {t.measured_s * 1e3:11.3f}  {t.expected_s * 1e3:11.3f}  {t.fraction:8.0%}  "
              f"{'SLOW' if t.slow else ''}")


def run(args, world) -> int:
    cfg = HealthConfig(nbytes=parse_size(args.nbytes), iters=args.iters, warmup=args.warmup, slow=args.slow,
                       search=args.search, max_pair_nodes=args.max_pair_nodes)
    cfg.check()
    profile = Profile.load(args.profile)
    if args.out:
        check_output_path(args.out, "health record")
    record = measure(world, profile, cfg)
    if record is None:
        return 0
    print(f"# health of {len(record.hosts)} node(s) x {record.ranks_per_node} rank(s), {format_size(cfg.nbytes)} "
          f"per exchange, against profile {profile.name!r}")
    _table("ranks (a ring within each node)", record.ranks)
    _table("node pairs (every rank of one node with the other's)", record.pairs)
    _table("halving search (rings of nodes)", record.groups)
    for s in record.suspects:
        print(f"SUSPECT {s.kind} {s.name}: {s.why}")
    if not record.suspects:
        print("# nothing slow")
    if args.out:
        record.save(args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if record.suspects else 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    return run_mpi_command(lambda: run(args, world), world, "calibrate health", "nothing was written",
                           spelled_by(parser))

