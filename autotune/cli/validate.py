"""``python -m autotune validate``: replay the collectives of several plans
through calibrate's backends and compare measured with predicted
communication time (AutoDDL Fig. 4). Run it under MPI, one rank per device:

    mpiexec -n 4 python -m autotune validate --backend mpi --profile gcp-a100
    mpirun -np 2 python -m autotune validate --backend nccl --gpus-per-node 2

The plans are a GPT model (by default one small layer) on the world seen as
--nodes x --gpus-per-node: the searched plan, data parallelism, Megatron and
SUMMA on every mesh, the S/B-only search and random plans, until --plans plans
with distinct predictions. Every collective runs on its real group (a
``comm.Split`` along the plan's mesh axes) with its real message size, all
groups at once (each timed batch starting at one barrier of every rank), as in
training; a plan's measured time is the sum over its
collectives of the median time times how often the plan issues it per step.

With --nodes-share-cores (nodes emulated on one machine, e.g. network
namespaces, whose ranks share its cores) the groups inside one node are timed
one node at a time while the other nodes' ranks sleep: on separate machines
they never meet, while on shared cores every rank's busy wait takes turns with
the others' at the scheduler's tick (a 2-rank exchange of 1 KiB in shared
memory: 16-64 ms with both nodes' groups at once, 3 us alone). Groups that
cross nodes still run all at once: they share the nodes' network, as in
training; their ranks wait by yielding the core to the rank whose step is next
(the MPI backend's ``yield_while_waiting``): spinning, a world allreduce of
128 KiB on 2 emulated nodes took 48-72 ms where the link's time is about 17.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


from calibrate.backends import REGISTRY as BACKENDS
from calibrate.backends.base import TimingMode
from calibrate.cli import command_parser, finite_float, run_on_ranks, seed_int
from calibrate.device.dtypes import dtype_info
from calibrate.errors import UserError
from calibrate.groups import sleeping_barrier
from calibrate.measure.stats import median, rel_err_pct, spearman
from calibrate.records import header
from calibrate.profile import DEFAULT_PROFILE, Profile
from calibrate.jsonfile import write_json
from calibrate.lock import DirLock
from models import load_model, model_kinds

from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.plan.validate import KIND, VERSION, candidate_plans, collective_rows, plan_collectives, tier_split

GPT_LAYER = {"layers": 1, "hidden": 1024, "heads": 16, "sequence": 512, "vocabulary": 8192, "batch": 8, "micro_batch": 8}


def parser() -> argparse.ArgumentParser:
    ap = command_parser("python -m autotune validate", __doc__)
    ap.add_argument("--backend", default="mpi", help="calibrate backend: mpi (anywhere) or nccl (GPUs)")
    ap.add_argument("--nodes", type=int, default=1, help="nodes the ranks span (default 1)")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default: world size / nodes)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help=f"profile for the predictions (default {DEFAULT_PROFILE})")
    ap.add_argument("--plans", type=int, default=8, help="how many plans to replay (default 8)")
    ap.add_argument("--model", default="gpt", help="model kind whose plans are replayed: " + ", ".join(model_kinds()))
    ap.add_argument("--preset", default=None, help="preset of the model (default: the one-layer GPT below); "
                                                   "python -m autotune --help lists them")
    for k, v in GPT_LAYER.items():
        ap.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=None, help=f"model field (default {v})")
    ap.add_argument("--dtype", default="float32", help="element type of the buffers (default float32)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls of each collective")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before timing each collective")
    ap.add_argument("--reps", type=int, default=5, help="timed batches of each collective, whose median is its time "
                                                       "(host mode; default 5)")
    ap.add_argument("--min-batch-ms", type=finite_float, default=0.0,
                    help="a timed batch lasts at least this long: collectives faster than that are timed over more "
                         "than --iters calls (a power of two, from a probe after the warmup), each sample their mean "
                         "per call, as calibrate run's option of the same name; give the profile's calibration's "
                         "value (default 0: always --iters calls)")
    ap.add_argument("--mode", default="host", help="timing mode: host, graph (nccl) or isolated")
    ap.add_argument("--nodes-share-cores", action="store_true",
                    help="the nodes are emulated on one machine and share its cores: time the groups inside a node "
                         "one node at a time, the other ranks asleep; in groups across nodes a waiting rank yields "
                         "its core (module docstring)")
    ap.add_argument("--out", default=None, help="directory for validate.json (default: none)")
    ap.add_argument("--seed", type=seed_int, default=0, help="seed of the random candidate plans")
    return ap


def check_args(args) -> None:
    """Every limit checked before MPI and the backend start (one line naming the flag and the fix)."""
    for flag, v, least in (("--plans", args.plans, 2), ("--nodes", args.nodes, 1), ("--iters", args.iters, 1),
                           ("--warmup", args.warmup, 0), ("--reps", args.reps, 1), ("--min-batch-ms", args.min_batch_ms, 0)):
        if v < least:
            raise UserError(f"{flag} {v:g} must be at least {least}" + (": Spearman needs two plans" if flag == "--plans" else ""))
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {args.gpus_per_node} must be at least 1")
    if args.backend not in BACKENDS:
        raise UserError(f"unknown --backend {args.backend!r}: choose from {', '.join(BACKENDS)}")
    TimingMode.parse(args.mode)
    dtype_info(args.dtype)
    Profile.load(args.profile)
    if args.out:
        try:
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create --out {args.out!r} ({e.strerror}): give a writable directory") from None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    lock = DirLock(args.out, "validate output directory") if args.out else None  # one run per --out
    try:
        return _validate(args, lock)
    finally:
        if lock is not None:
            lock.release()


def _validate(args, lock: DirLock | None) -> int:
    check_args(args)
    try:
        from mpi4py import MPI
    except ImportError:
        raise UserError("validate needs mpi4py: install it and run under mpiexec") from None
    from calibrate.backends import make_backend

    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    gpus = args.gpus_per_node or max(size // args.nodes, 1)
    if args.nodes * gpus != size:
        raise UserError(f"{args.nodes} nodes x {gpus} ranks per node != {size} MPI ranks: match --nodes/--gpus-per-node to mpiexec -n")
    if size < 2:
        raise UserError("validate times the plans' collectives between ranks, and one rank has none: "
                        "run it under mpiexec -n 2 or more")
    cluster = Cluster(args.nodes, gpus)

    def build_plans() -> list:
        if lock is not None:  # on rank 0, before any rank measures: a refusal ends every rank
            lock.acquire()
        fields = {k: getattr(args, k) for k in GPT_LAYER if getattr(args, k) is not None}
        if args.model == "gpt" and args.preset is None:
            fields = {**GPT_LAYER, **fields}
        graph = load_model(args.model, args.preset, fields)
        problem = Problem(graph, Coster(Profile.load(args.profile), cluster), None)
        found = candidate_plans(problem, args.plans, args.seed)
        print(f"[validate] {len(found)} plans of {graph.model} on {cluster}, backend {args.backend}", file=sys.stderr,
              flush=True)
        return found

    # built on rank 0 and broadcast; a bad model is one error (rank 0's) and every rank exits with it
    plans = run_on_ranks(world, build_plans, "autotune validate")
    if plans is None:
        return 2
    comms: dict = {}
    measured: dict = {}
    coords = cluster.coords(rank)
    keys = sorted({(c, a, nb) for p in plans for c, a, nb, _ in plan_collectives(p)})
    for i, (coll, axes, nbytes) in enumerate(keys):
        if axes not in comms:
            color = int(sum(v * 1000003 ** k for k, v in enumerate(c for a, c in enumerate(coords) if a not in axes)))
            key = 0
            for a in axes:
                key = key * cluster.axis_sizes[a] + coords[a]
            sub = world.Split(color % (2**31 - 1), key)
            comms[axes] = make_backend(args.backend, sub)
            comms[axes].yield_while_waiting = args.nodes_share_cores and cluster.group(axes).nodes > 1
        def measure() -> float:
            return median(comms[axes].measure(coll, nbytes, args.dtype, args.iters, args.warmup, args.mode, args.reps,
                                              min_batch_s=args.min_batch_ms / 1e3))

        if args.nodes_share_cores and cluster.group(axes).nodes == 1 and args.nodes > 1:
            comms[axes].start_comm = None
            t = 0.0
            for node in range(args.nodes):
                if rank // gpus == node:
                    t = measure()
                sleeping_barrier(world)
        else:
            comms[axes].start_comm = world  # every group of these axes starts each batch together
            t = measure()
        measured[(coll, axes, nbytes)] = float(world.allreduce(t, op=MPI.MAX))
        if rank == 0:
            print(f"[validate] {i + 1}/{len(keys)} {coll} on {len(axes)} axes, {nbytes} B: {measured[(coll, axes, nbytes)] * 1e3:.3f} ms",
                  file=sys.stderr, flush=True)
    for backend in comms.values():
        backend.close()
    if rank != 0:
        return 0
    rows = []
    for p in plans:
        meas = sum(per * measured[(c, a, nb)] for c, a, nb, per in plan_collectives(p))
        rows.append({"plan": p.strategy, "predicted_s": p.costs.total_s, "measured_s": meas,
                     "tiers": tier_split(p, measured)})
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    w = max(len(r["plan"]) for r in rows)
    tiers = sorted({t for r in rows for t in r["tiers"]})
    print(f"{'plan'.ljust(w)}  predicted s  measured s  error" + "".join(f"  {t} pred / meas s" for t in tiers))
    for r in sorted(rows, key=lambda r: r["measured_s"]):
        split = "".join(f"  {r['tiers'].get(t, {}).get('predicted_s', 0.0):8.4g} / "
                        f"{r['tiers'].get(t, {}).get('measured_s', 0.0):<8.4g}" for t in tiers)
        print(f"{r['plan'].ljust(w)}  {r['predicted_s']:11.4g}  {r['measured_s']:10.4g}  "
              f"{rel_err_pct(r['predicted_s'], r['measured_s']):+5.0f}%{split}")
    print(f"Spearman rank correlation (predicted vs measured, {len(rows)} plans): {'-' if rho is None else format(rho, '.3f')}")
    colls = collective_rows(plans, measured)
    print("per collective (group ranks x nodes, tier), heaviest first: predicted / measured ms, all plans' seconds")
    for c in sorted(colls, key=lambda c: -c["plans_measured_s"]):
        print(f"  {c['collective']:<13} {c['ranks']}x{c['nodes']} {c['tier']:<5} {c['nbytes']:>9} B  "
              f"{c['predicted_s'] * 1e3:9.3f} / {c['measured_s'] * 1e3:9.3f} ms  "
              f"{c['plans_predicted_s']:8.4g} / {c['plans_measured_s']:8.4g} s")
    if args.out:
        out = write_json(Path(args.out) / "validate.json",
                         {**header(KIND, VERSION), "backend": args.backend, "cluster": str(cluster),
                          "profile": args.profile, "mode": args.mode, "dtype": args.dtype,
                          "nodes_share_cores": args.nodes_share_cores, "reps": args.reps,
                          "min_batch_s": args.min_batch_ms / 1e3,
                          "plans": rows, "spearman": rho, "collectives": colls},
                         "validation record")
        print(f"wrote {out}")
    return 0
