"""``python -m autotune reshard``: plan a cross-mesh resharding, compare strategies
and solvers against the lower bound, run the paper's cases and pipeline schedules.

    python -m autotune reshard --src-mesh 2,4 --src-spec S0RR --dst-mesh 2,4 --dst-spec S0RR \\
        --shape 1024,1024,512 [--profile P] [--plan-out plan.json]
    python -m autotune reshard --case 4          # a case of the paper's Table 2
    python -m autotune reshard --all-cases --pipeline u-transformer-like --results reshard.json
    mpiexec -n 8 python -m autotune reshard --execute mpi --scenario S0RR@2,2:RRR@2,2 --shape 64,64,32 \\
        --devices-per-host 2 --solvers naive,ensemble    # plan every strategy, run each plan, check it

Cases run on the profile of the paper's cluster (``aws-p3-v100``, assumed: hosts
of 4 V100 on NVLink, 10 Gb/s between hosts) unless --profile says otherwise;
other tasks default to ``calibrate.profile.DEFAULT_PROFILE``.
"""
from __future__ import annotations

import argparse
import math
import sys

from autotune.reshard.cases import build_task, case_names, case_profile, load_case, parse_scenario
from autotune.reshard.pipeline import PHASES, SCHEDULES, exposed_time, hidden_fraction, load_pipelines, simulate
from autotune.reshard.plan import compare, make_plan
from autotune.reshard.solvers import SOLVERS, SolverConfig
from autotune.reshard.stagecomm import pipeline_from_preset
from autotune.reshard.strategies import STRATEGIES
from calibrate import profile as profiles
from calibrate.cli import command_parser, finite_float, run_on_ranks, seed_int
from calibrate.errors import UserError
from calibrate.outputs import check_output_path
from kernels.reshard.cli import execute_and_report
from kernels.reshard.plan import Plan
from kernels.reshard.program import BACKENDS
from kernels.reshard.results import ReshardResults
from kernels.reshard.spec import parse_mesh_shape
from kernels.reshard.tasks import ReshardTask

BASELINE_SOLVER = "greedy_in_order"  # the paper's baselines: least-loaded sender per slice, Alpa's order (§5.1.2)


def _parser() -> argparse.ArgumentParser:
    p = command_parser("python -m autotune reshard", __doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--src-mesh", help="source mesh as hosts,devices (e.g. 2,4)")
    p.add_argument("--src-spec", help="source sharding spec, one of R/S0/S1/S01 per dimension (e.g. S0RR)")
    p.add_argument("--dst-mesh", help="destination mesh as hosts,devices")
    p.add_argument("--dst-spec", help="destination sharding spec")
    p.add_argument("--shape", help="tensor shape, e.g. 1024,1024,512")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--shared-devices", action="store_true",
                   help="put the destination mesh on the source mesh's devices (default: on the next hosts)")
    p.add_argument("--devices-per-host", type=int, help="devices per host (default: the profile's gpus_per_node)")
    p.add_argument("--case", help=f"run a case of the paper's Table 2 ({', '.join(case_names())})")
    p.add_argument("--all-cases", action="store_true", help="run all nine cases")
    p.add_argument("--pipeline", help="simulate the pipeline schedules on a preset (e.g. u-transformer-like)")
    p.add_argument("--micro-batches", type=int, help="override the pipeline preset's micro-batch count")
    p.add_argument("--profile", help="profile name or JSON file")
    p.add_argument("--strategy", default="broadcast", choices=list(STRATEGIES), help="strategy of the chosen plan")
    p.add_argument("--solver", default="ensemble", choices=list(SOLVERS), help="solver of the chosen plan")
    p.add_argument("--time-budget", type=finite_float, default=0.5, help="seconds for the DFS solver (default 0.5)")
    p.add_argument("--rounds", type=int, default=16, help="random orders per randomized-greedy step")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the randomized-greedy solver's orders")
    p.add_argument("--plan-out", help="write the chosen plan as JSON (one task only)")
    p.add_argument("--results", help="write all results as JSON for the report (kind 'reshard')")
    p.add_argument("--jobs", type=int, default=12, help="how many jobs of the chosen plan to print")
    p.add_argument("--execute", choices=list(BACKENDS),
                   help="under mpiexec: plan every strategy with each of --solvers, run each plan on this job's "
                        "ranks (device id = rank) with this backend and check every tile")
    p.add_argument("--scenario", action="append", default=[],
                   help="with --execute, a task as SRCSPEC@H,D[devices]:DSTSPEC@H,D[devices][+shared] with "
                        "--shape; repeat for several")
    p.add_argument("--solvers", help="with --execute, comma-separated solvers (default: --solver)")
    p.add_argument("--iters", type=int, default=1,
                   help="with --execute, timed runs per plan, after one untimed run when above 1")
    return p


def _progress(msg: str) -> None:
    print(f"[reshard] {msg}", file=sys.stderr, flush=True)


# the most elements a resharded tensor may have (2^48: 1 PiB in float32)
MAX_TENSOR_ELEMENTS = 2**48


def shape_arg(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError:
        raise UserError(f"tensor shape {text!r} is not a list of integers: write e.g. 1024,1024,512") from None
    if not shape:
        raise UserError("empty tensor shape: write e.g. --shape 1024,1024,512")
    if min(shape) < 1:
        raise UserError(f"tensor shape {text!r} has a dimension below 1: every size must be positive")
    elements = math.prod(shape)
    if elements > MAX_TENSOR_ELEMENTS:
        raise UserError(f"tensor shape {text!r} has {elements:.3g} elements, over the planner's limit of "
                        f"{MAX_TENSOR_ELEMENTS:.3g} (2^48, a petabyte in float32, more than any cluster holds): "
                        f"give a smaller shape")
    return shape


def devices_per_host(args, prof, meshes: tuple[tuple[int, int], ...] = ()) -> int:
    """--devices-per-host, else the profile's gpus_per_node, else the most devices a mesh puts on a host."""
    if args.devices_per_host is not None:
        if args.devices_per_host < 1:
            raise UserError(f"--devices-per-host must be at least 1, got {args.devices_per_host}")
        return args.devices_per_host
    n = prof.hardware.get("gpus_per_node")
    if n:
        return int(n)
    if meshes:
        return max(m[1] for m in meshes)
    raise UserError(f"profile {prof.name!r} does not say how many GPUs a host has: give --devices-per-host")


# the most devices one mesh may have: the planner's tasks grow with the product of the two meshes'
# devices (a 16 x 8 mesh to itself already takes minutes on one CPU core)
MAX_MESH_DEVICES = 1024


def mesh_arg(text: str, what: str) -> tuple[int, int]:
    mesh = parse_mesh_shape(text)
    if min(mesh) < 1:
        raise UserError(f"{what} {text!r} has an empty axis: hosts and devices must be at least 1, e.g. 2,4")
    devices = mesh[0] * mesh[1]
    if devices > MAX_MESH_DEVICES:
        raise UserError(f"{what} {text!r} has {devices:,} devices, over the planner's limit of {MAX_MESH_DEVICES:,} "
                        f"(its work grows with the devices of both meshes multiplied: about {devices ** 2:.2g} "
                        f"device pairs here): plan a smaller mesh")
    return mesh


def _table(plans: dict, bound: float, strategies, solvers) -> str:
    w = max(len(s) for s in solvers)
    lines = [f"{'strategy':18s}" + "".join(f"{s:>{w + 2}s}" for s in solvers) + "   (seconds)"]
    for st in strategies:
        lines.append(f"{st:18s}" + "".join(f"{plans[(st, so)].makespan:>{w + 2}.4f}" for so in solvers))
    lines.append(f"{'lower bound':18s}{bound:>{w + 2}.4f}")
    return "\n".join(lines)


def run_task(name: str, task: ReshardTask, prof, args, cfg) -> dict:
    strategies, solvers = list(STRATEGIES), list(SOLVERS)
    plans = compare(task, prof, strategies, solvers, cfg, progress=_progress)
    chosen = plans[(args.strategy, args.solver)]
    bound = chosen.lower_bound
    print(f"== {name}: {task.src_spec} on {task.src_mesh.shape} -> {task.dst_spec} on {task.dst_mesh.shape}, "
          f"tensor {task.shape} {task.dtype}, profile {prof.name}")
    print(f"unit tasks: {len(chosen.units)}; jobs in the chosen plan: {len(chosen.jobs)}")
    print(_table(plans, bound, strategies, solvers))
    print(f"chosen: {chosen.strategy} + {chosen.solver}: {chosen.makespan:.4f} s, "
          f"{chosen.makespan / bound:.3f}x the lower bound")
    for st in ("send_recv", "local_allgather", "global_allgather"):
        base = plans[(st, BASELINE_SOLVER)].makespan
        print(f"  vs {st} ({BASELINE_SOLVER}): {base / chosen.makespan:.2f}x faster")
    for j in chosen.jobs[:args.jobs]:
        print(f"  t={j.start:8.4f}s +{j.duration:7.4f}s  task {j.task:3d}  {j.sender:3d} -> "
              f"{list(j.receivers)}  {j.nbytes / 2**20:.1f} MiB  K={j.partitions}")
    if len(chosen.jobs) > args.jobs:
        print(f"  ... {len(chosen.jobs) - args.jobs} more jobs (--jobs N shows more)")
    return {"case": name, "task": task.to_dict(), "profile": prof.name, "lower_bound": bound,
            "unit_tasks": len(chosen.units),
            "times": {st: {so: plans[(st, so)].makespan for so in solvers} for st in strategies},
            "chosen": chosen.to_dict()}


def run_pipeline(name: str, prof, args, cfg) -> dict:
    _progress(f"planning the boundary communication of {name}")
    spec = pipeline_from_preset(name, prof, args.micro_batches, cfg)
    print(f"== pipeline {name}: {spec.stages} stages, {spec.micro_batches} micro-batches, profile {prof.name}")
    print(f"communication per micro-batch: forward {list(map(lambda x: round(x, 4), spec.comm_forward))} s, "
          f"backward {list(map(lambda x: round(x, 4), spec.comm_backward))} s")
    if spec.skips:
        print("skip connections: " + ", ".join(f"{k.src}->{k.dst} {k.forward:.4f} s / {k.backward:.4f} s"
                                             for k in spec.skips))
    print(f"{'schedule':16s}{'iteration s':>12s}{'mb/s':>8s}{'hidden':>8s}{'steady':>8s}{'exposed s':>11s}"
          f"  peak activations per stage")
    out = {}
    # every schedule with overlapped transfers, and 1F1B as Alpa runs it (blocking send/recv, the paper's "Broadcast")
    for sch, overlap in [(s, True) for s in SCHEDULES] + [("1f1b", False)]:
        r = simulate(spec, sch, overlap=overlap)
        hid, steady, exp = hidden_fraction(r), hidden_fraction(r, "steady"), exposed_time(spec, sch, overlap)
        key = sch if overlap else f"{sch}_blocking"
        print(f"{key:16s}{r.makespan:12.3f}{r.throughput:8.2f}{hid:8.1%}{'-' if steady is None else f'{steady:.1%}':>8s}{exp:11.3f}  "
              f"{r.peak_activations} ({', '.join(f'{b / 2**30:.1f} GiB' for b in r.peak_memory)})")
        out[key] = dict(r.to_dict(), hidden=hid, exposed=exp, overlap=overlap,
                        hidden_by_phase={ph: hidden_fraction(r, ph) for ph in PHASES})
    print("hidden: share of each transfer during which its consumer stage computes; steady: only the transfers "
          "starting inside the window where every stage alternates F and B; exposed: makespan with minus without "
          "communication; _blocking: send/recv in the stages' own streams (Alpa's runtime), nothing overlapped")
    fields = {k: getattr(spec, k) for k in spec.__dataclass_fields__ if k != "skips"}
    fields["skips"] = [k.__dict__ for k in spec.skips]
    return {"name": name, "spec": fields, "schedules": out}


def check_args(args) -> None:
    """Counts, budgets and output paths, before any planning."""
    if args.time_budget < 0:
        raise UserError(f"--time-budget must be >= 0 seconds, got {args.time_budget}")
    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1, got {args.rounds}")
    if args.jobs < 0:
        raise UserError(f"--jobs must be >= 0, got {args.jobs}")
    if args.iters < 1:
        raise UserError(f"--iters must be >= 1, got {args.iters}")
    if args.micro_batches is not None and args.micro_batches < 1:
        raise UserError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.pipeline:
        known = list(load_pipelines()["pipelines"])
        if args.pipeline not in known:
            raise UserError(f"unknown pipeline preset {args.pipeline!r}: choose one of {', '.join(known)}")
    for flag, path in (("--plan-out", args.plan_out), ("--results", args.results)):
        if path:
            check_output_path(path, f"{flag} file")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    check_args(args)
    if args.execute:
        return execute(args)
    cfg = SolverConfig(time_budget=args.time_budget, rounds=args.rounds, seed=args.seed)
    explicit = [args.src_mesh, args.src_spec, args.dst_mesh, args.dst_spec, args.shape]
    if args.scenario:
        raise UserError("scenarios are run by --execute: add --execute mpi or --execute nccl")
    if not (any(explicit) or args.case or args.all_cases or args.pipeline):
        raise UserError("nothing to do: give --src-mesh/--src-spec/--dst-mesh/--dst-spec/--shape, "
                        "--case N, --all-cases or --pipeline NAME (see --help)")
    if any(explicit) and not all(explicit):
        raise UserError("a task needs all of --src-mesh, --src-spec, --dst-mesh, --dst-spec and --shape")
    prof = task_profile(args)
    results = ReshardResults(prof.name)
    tasks = tasks_of(args, prof)
    for name, task, paper_speedup in tasks:
        entry = run_task(name, task, prof, args, cfg)
        if paper_speedup:
            entry["paper_speedup_vs_allgather"] = paper_speedup
        results.cases.append(entry)
    if args.plan_out:
        if len(tasks) != 1:
            raise UserError("--plan-out writes one plan: give one task or one --case")
        path = Plan.from_dict(results.cases[0]["chosen"]).save(args.plan_out)
        print(f"plan written to {path}")
    if args.pipeline:
        results.pipelines.append(run_pipeline(args.pipeline, prof, args, cfg))
    if args.results:
        print(f"results written to {results.save(args.results)}")
    return 0


def task_profile(args):
    explicit = [args.src_mesh, args.src_spec, args.dst_mesh, args.dst_spec]
    paper = args.case or args.all_cases or args.pipeline
    return profiles.Profile.load(args.profile or (case_profile() if paper and not any(explicit)
                                                  else profiles.DEFAULT_PROFILE))


def tasks_of(args, prof) -> list[tuple[str, ReshardTask, float | None]]:
    """(name, task, the paper's speed-up) of the explicit task and the cases asked for."""
    explicit = [args.src_mesh, args.src_spec, args.dst_mesh, args.dst_spec, args.shape]
    if any(explicit[:4]) and not all(explicit):
        raise UserError("a task needs all of --src-mesh, --src-spec, --dst-mesh, --dst-spec and --shape")
    tasks = []
    if all(explicit):
        src, dst = mesh_arg(args.src_mesh, "--src-mesh"), mesh_arg(args.dst_mesh, "--dst-mesh")
        shape = shape_arg(args.shape)
        task = build_task(src, args.src_spec, dst, args.dst_spec, shape, args.dtype,
                          devices_per_host(args, prof, (src, dst)), shared=args.shared_devices)
        tasks.append(("task", task, None))
    names = case_names() if args.all_cases else ([args.case] if args.case else [])
    dph = args.devices_per_host or int(prof.hardware.get("gpus_per_node") or 4)
    for n in names:
        c = load_case(n, dph)
        tasks.append((f"case {c.name}", c.task, c.paper_speedup))
    return tasks


def execute(args) -> int:
    """``--execute``: rank 0 plans every task (explicit, cases, scenarios) with every strategy
    and each of ``--solvers``; every rank runs every plan (``kernels.reshard``) and checks it."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    cfg = SolverConfig(time_budget=args.time_budget, rounds=args.rounds, seed=args.seed)

    def plan_all():
        prof = task_profile(args)
        tasks = tasks_of(args, prof)
        if args.scenario:
            if not args.shape:
                raise UserError("scenarios need the tensor's --shape, e.g. --shape 64,64,32")
            dph = devices_per_host(args, prof)
            tasks += [(sc, parse_scenario(sc, shape_arg(args.shape), args.dtype, dph), None) for sc in args.scenario]
        if not tasks:
            raise UserError("nothing to execute: give --scenario, a task (--src-mesh ... --shape) or --case")
        solvers = (args.solvers or args.solver).split(",")
        for sol in solvers:
            if sol not in SOLVERS:
                raise UserError(f"unknown solver {sol!r}: choose from {', '.join(SOLVERS)}")
        for name, task, _ in tasks:
            if task.ranks_needed > comm.Get_size():
                raise UserError(f"{name} needs {task.ranks_needed} ranks but {comm.Get_size()} run: launch more")
        return prof.name, [(name, make_plan(task, prof, st, sol, cfg))
                           for name, task, _ in tasks for st in STRATEGIES for sol in solvers]

    planned = run_on_ranks(comm, plan_all, "autotune reshard")
    if planned is None:
        return 2
    profile, plans = planned
    how = argparse.Namespace(backend=args.execute, seed=args.seed, iters=args.iters, results=args.results)
    return execute_and_report(plans, how, comm, "autotune reshard", profile)
