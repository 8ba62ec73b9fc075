"""``python -m calibrate run``: time the collectives over a sweep of sizes,
nccl-tests style, one process per rank (mpiexec or srun)."""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from mpi4py import MPI

from calibrate.backends import REGISTRY as BACKENDS
from calibrate import run_limits
from calibrate.backends import make_backend
from calibrate.backends.base import TimingMode
from calibrate.cli import add_timing_args, command_parser, finite_float, run_mpi_command, spelled_by
from calibrate.collectives import Collective, busbw_factor
from calibrate.device.dtypes import dtype_size
from calibrate.errors import NAME, OptionError, UserError
from calibrate.groups import parse_group_kinds, sleeping_barrier, split, topology
from calibrate.records import header
from calibrate.refine import FLOOR
from calibrate.cli.refine import refine_group
from calibrate.results import KIND, VERSION, ResultsDir
from calibrate.sizes import align, odd_multiple, parse_size, rounded_note, sweep
from calibrate.measure.stats import summarize
from calibrate.measure.heldout import random_sizes as draw_random_sizes

MAX_BATCH_MS = 10_000
HEADER = ("#{:>12} {:>12} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}".format(
    "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong")
    + "\n#{:>12} {:>12} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}".format(
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""))
# random sizes come interleaved over the collectives: each row names its collective and its place in the run
RANDOM_HEADER = "\n".join(line + f" {name:<14} {done:>9}" for line, name, done in
                          zip(HEADER.split("\n"), ("collective", ""), ("done", "")))


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "python -m calibrate run",
        "Time collectives over a sweep of sizes (one process per GPU or rank, "
        "under mpiexec or srun) and write a resumable results directory.")
    add_timing_args(p, mode_default="host", min_default="1K")
    p.add_argument("--factor", "-f", type=finite_float, default=2.0, help="size multiplier between steps. Default 2")
    p.add_argument("--check", action="store_true", help="after timing, check each size of the sweep on fresh "
                   "random data; exit non-zero if anything is wrong")
    p.add_argument("--refine", action="store_true",
                   help="after each collective's sweep, locate the steps of its curve (NCCL's protocol and "
                        "algorithm switches) by bisection on aligned sizes, to 1/32 of an octave")
    p.add_argument("--refine-budget", type=finite_float, default=0.25,
                   help="refinement time, as a fraction of the time the sweeps of all collectives took (shared by "
                        "the steps of all curves; the last point may overrun it by its own time); it grows to what "
                        "bracketing every step found needs, up to --refine-cap. Default 0.25")
    p.add_argument("--refine-cap", type=finite_float, default=2.0,
                   help="the most refinement time, as a fraction of the sweeps' time, when the steps found need "
                        "more than --refine-budget (a curve with many steps). Default 2")
    p.add_argument("--refine-points", type=int, default=64,
                   help="most refined sizes per collective, raised to the bisections its steps need. Default 64")
    p.add_argument("--refine-tol", type=finite_float, default=FLOOR,
                   help=f"least relative disagreement with the smooth model that counts as a step (the "
                        f"confidence intervals raise it where the data are noisy). Default {FLOOR}")
    p.add_argument("--size-unit", type=int, default=0, metavar="BYTES",
                   help="move every swept and refined size to an odd multiple of this many bytes per rank (256: "
                        "aligned as most sizes are, and not to 8 KiB, at which NCCL is up to 8%% faster at "
                        "48-250 KiB than at the sizes around); 0: the sizes as the sweep and the bisection give "
                        "them. Default 0")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="also measure N sizes per collective drawn at random (log-uniform, off the grid), in the "
                        "same run and the same way as the sweep (each in turn with the sweep's sizes, in order, "
                        "checked when --check is on), into a results directory of their own (--random-out) that "
                        "no fit reads: python -m calibrate fit --validation judges a profile on them")
    p.add_argument("--random-seed", type=int, default=0, help="seed of the random sizes. Default 0")
    p.add_argument("--random-min-bytes", default=None, help="smallest random size. Default --min-bytes")
    p.add_argument("--random-max-bytes", default=None, help="largest random size. Default --max-bytes")
    p.add_argument("--random-align", default="256", help="random sizes are multiples of this many bytes per rank. "
                                                         "Default 256")
    p.add_argument("--random-out", default=None, help="results directory of the random sizes. Default: --out "
                                                      "with -random appended")
    return p


def _agree(world, problem: UserError | None) -> None:
    """Raise the first problem any rank found, on every rank."""
    problems = [m for m in world.allgather(problem) if m]
    if problems:
        raise problems[0]


def _on_root(world, work) -> None:
    """``work()`` on rank 0 (a write); its ``UserError`` raised on every rank, so that none waits."""
    problem = None
    if world.Get_rank() == 0:
        try:
            work()
        except UserError as e:
            problem = e
    _agree(world, problem)


def pick_backend(name: str) -> str:
    if name != "auto":
        if name not in BACKENDS:
            raise UserError(f"unknown backend {name!r}: choose from auto, {', '.join(BACKENDS)}")
        return name
    try:
        import cupy

        return "nccl" if cupy.cuda.runtime.getDeviceCount() > 0 else "mpi"
    except Exception:  # noqa: BLE001  (no cupy or no driver: no GPU)
        return "mpi"


def _row(nbytes, count, dtype, coll, t, busbw, wrong) -> str:
    redop = "sum" if coll in (Collective.ALLREDUCE, Collective.REDUCESCATTER) else "none"
    root = 0 if coll is Collective.BROADCAST else -1
    algbw = nbytes / t / 1e9
    w = "N/A" if wrong < 0 else str(wrong)
    return (f" {nbytes:>12} {count:>12} {dtype:>9} {redop:>6} {root:>5} {t * 1e6:>10.2f} "
            f"{algbw:>8.2f} {busbw:>8.2f} {w:>7}")


def _check_resources(args, world, colls, sizes, backend_name, hosts, say) -> bool:
    """Memory for the largest size on every rank (host memory per host, or the GPU's), before any work;
    a warning when a host has more ranks than cores, and whether one has (the same answer on every rank)."""
    here = socket.gethostname()
    sharing = hosts.count(here)
    need = run_limits.buffer_bytes(colls, max(sizes), args.dtype, world.Get_size(), args.check)
    problem = None
    try:
        if backend_name == "nccl":
            import cupy

            free, _ = cupy.cuda.runtime.memGetInfo()
            run_limits.check_memory(need, 1, free, "the GPU", "lower --max-bytes (-e)")
        else:
            run_limits.check_memory(need, sharing, run_limits.host_available_bytes(), f"host {here}",
                                    "lower --max-bytes (-e) or run fewer ranks per host")
    except UserError as e:
        problem = e
    _agree(world, problem)
    affinities = world.allgather((here, run_limits.cores()))
    ncores = run_limits.host_cores(a for h, a in affinities if h == here)
    warning = run_limits.oversubscription_warning(sharing, ncores, here)
    warnings = [w for w in world.allgather(warning) if w]  # a rank warns where its host has more ranks than cores
    if warnings:
        say(warnings[0], file=sys.stderr)
    return bool(warnings)


def run(args, world, random_sizes: dict[str, list[int]] | None = None) -> int:
    """Measure the sweep (or, from ``calibrate validate --random``, the given sizes per collective);
    the results directories are locked (on rank 0) while it runs."""
    with contextlib.ExitStack() as held:
        return _run(args, world, random_sizes, held)


def _run(args, world, random_sizes: dict[str, list[int]] | None, held: contextlib.ExitStack) -> int:
    rank = world.Get_rank()
    say = (lambda *a, **k: print(*a, **k, flush=True)) if rank == 0 else (lambda *a, **k: None)
    run_limits.check_counts(args.iters, args.warmup, args.reps)
    colls = [Collective.parse(c) for c in args.collectives.split(",") if c.strip()]
    if not colls:
        raise UserError("--collectives is empty: name at least one collective")
    mode = TimingMode.parse(args.mode)
    dtype_size(args.dtype)
    kinds = parse_group_kinds(args.groups)
    backend_name = pick_backend(args.backend)
    refining = args.refine
    if refining and (args.refine_points < 0 or args.refine_budget < 0 or args.refine_tol < 0):
        raise UserError("--refine-points, --refine-budget and --refine-tol must not be negative")
    if args.min_batch_ms < 0:
        raise OptionError("min_batch_ms", f"must not be negative, got {args.min_batch_ms}")
    if args.min_batch_ms > MAX_BATCH_MS:
        raise OptionError("min_batch_ms", f"is {args.min_batch_ms:g} ms a batch: at most {MAX_BATCH_MS} ms "
                                          f"(a second is already thousands of calls at any size)")
    random_n = getattr(args, "random", 0) if random_sizes is None else 0
    _agree(world, None)  # every rank parsed the same arguments
    if mode is TimingMode.GRAPH and backend_name != "nccl":
        raise UserError("graph timing needs GPUs: use --backend nccl, or --mode host or isolated")
    if args.dtype == "bfloat16" and backend_name != "nccl":
        raise UserError("bfloat16 needs the nccl backend: use --dtype float16 or float32 with mpi")
    max_default = "1G" if backend_name == "nccl" else "64M"
    sizes = [] if random_sizes is not None else \
        sweep(parse_size(args.min_bytes), parse_size(args.max_bytes or max_default), args.factor)
    unit = getattr(args, "size_unit", 0) * world.Get_size()
    if getattr(args, "size_unit", 0) < 0:
        raise OptionError("size_unit", f"must not be negative, got {args.size_unit}")
    if unit:
        sizes = sorted({odd_multiple(n, unit) for n in sizes})
    plan = random_sizes or {}
    beside = {}  # collective -> random sizes measured in turn with the sweep's (--random)
    if random_n:
        beside = _random_plan(args, colls, world.Get_size(), max_default)
    phase = "sweep" if random_sizes is None else "random"
    check = args.check
    run_limits.check_world(world.Get_size())

    device = None
    if backend_name == "nccl":
        from calibrate.device.gpu import select_gpu

        device = select_gpu(world)
    node, nnodes, _, hosts = topology(world)
    if nnodes == 1 and set(kinds) == {"inter"}:
        raise OptionError("groups", "is inter alone, which measures between nodes, and every rank is on one node: "
                                    "add world or intra, or run on 2 or more nodes")
    oversubscribed = _check_resources(args, world, colls, sizes + [n for v in {**plan, **beside}.values() for n in v],
                                      backend_name, hosts, say)
    out = args.out or os.path.join("results", "calib-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    meta = {
        **header(KIND, VERSION),
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "config": {"backend": backend_name, "mode": mode.value, "dtype": args.dtype, "iters": args.iters,
                   "warmup": args.warmup, "reps": args.reps, "min_batch_s": args.min_batch_ms / 1e3,
                   "world_size": world.Get_size(),
                   "hosts": sorted(set(hosts)), "collectives": [c.value for c in colls],
                   "sizes": sizes if random_sizes is None else random_sizes, "groups": kinds, "phase": phase,
                   **({"refine": {"budget": args.refine_budget, "points": args.refine_points,
                                  "tol": args.refine_tol}} if refining else {}),
                   **({"size_unit": args.size_unit} if unit else {})},
        "ranks": world.gather({"rank": rank, "host": socket.gethostname(), "device": device,
                               "cores": sorted(run_limits.cores())}, root=0),
        "nodes": nnodes,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("NCCL_", "COMMTUNE_NCCL_", "SLURM_JOB", "OMPI_COMM_WORLD_SIZE"))},
    }
    rd = ResultsDir(Path(out))
    random_out = (args.random_out or out.rstrip("/") + "-random") if beside else None
    meta_random = _random_meta(meta, beside, args, out) if beside else None
    rd_random = ResultsDir(Path(random_out)) if beside else None
    stored, stored_random, problem = {}, {}, None
    if rank == 0:
        try:
            held.callback(rd.close)
            rd.prepare(meta, args.resume)
            stored = rd.measured()
            if rd_random:
                held.callback(rd_random.close)
                rd_random.prepare(meta_random, args.resume)
                stored_random = rd_random.measured()
        except UserError as e:
            problem = e
    _agree(world, problem)
    stored, stored_random = world.bcast((stored, stored_random), root=0)  # the same refinement on every rank
    if stored or stored_random:
        say(f"# resuming {out}: {len(stored) + len(stored_random)} sizes already measured are skipped",
            file=sys.stderr)
    sinks = {"sweep": (rd, stored), "refine": (rd, stored), "random": (rd_random, stored_random) if beside
             else (rd, stored)}

    total_wrong, checked, versions_written = 0, 0, False
    for kind in kinds:
        comm, info = split(world, kind)
        if comm is None:
            say(f"# group {kind}: groups of one rank ({nnodes} node(s)), nothing to measure", file=sys.stderr)
            continue
        if kind != "world" and info.ranks == world.Get_size():
            say(f"# group {kind}: the same ranks as world, measured once as world", file=sys.stderr)
            comm.Free()
            continue
        if kind == "pairs" and "intra" in kinds and info.ranks == world.Get_size() // nnodes:
            say("# group pairs: the same ranks as intra (2 per node), measured once as intra", file=sys.stderr)
            comm.Free()
            continue
        backend = make_backend(backend_name, comm, **({"device": device} if device is not None else {}))
        # on shared cores a waiting rank yields its core: groups across emulated nodes run with every node's ranks at
        # once, and a host with more ranks than cores (4 MPI ranks on 2 cores: a spinning rank held its core until the
        # scheduler's tick, a 1 KiB allreduce took 25 ms, sometimes more than a 16 KiB one)
        backend.yield_while_waiting = (args.nodes_share_cores and info.nodes > 1) or oversubscribed
        if not versions_written:
            versions = world.gather(backend.versions(), root=0)

            def write_versions():
                meta["ranks"] = [dict(r, **v) for r, v in zip(meta["ranks"], versions)]
                rd.write_meta(meta)
                if rd_random:
                    meta_random["ranks"] = meta["ranks"]
                    rd_random.write_meta(meta_random)
            _on_root(world, write_versions)
            versions_written = True
        label = f"{kind}:{info.ranks}x{info.nodes}"
        def measure_size(coll: Collective, nbytes: int, why: str, with_check: bool, tag: str = "") -> None:
            """Time one size, check it if asked, and put it on disk (rank 0) and in ``stored``."""
            nonlocal total_wrong, checked
            start = time.perf_counter()
            def timed():
                return backend.measure(coll, nbytes, args.dtype, args.iters, args.warmup, mode, args.reps,
                                       min_batch_s=args.min_batch_ms / 1e3)
            if args.nodes_share_cores and info.nodes == 1 and nnodes > 1:
                backend.start_comm = None
                samples = None
                for turn in range(nnodes):  # one node's groups at a time, the others asleep
                    if turn == node:
                        samples = timed()
                    sleeping_barrier(world)
            else:
                backend.start_comm = world  # the groups of this kind start each batch together
                samples = timed()
            world.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)  # concurrent groups: the slowest
            wrong = -1
            if with_check:
                # each group's check is summed over its ranks: count every group once
                wrong = world.allreduce(backend.check(coll, nbytes, args.dtype, seed=nbytes),
                                        op=MPI.SUM) // info.ranks
                total_wrong += max(wrong, 0)
                checked += 1
            st = summarize(samples)
            wall = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
            algbw = nbytes / st["median_s"] / 1e9
            busbw = algbw * busbw_factor(coll, info.ranks)
            count = align(coll, nbytes, info.ranks, args.dtype)[1]
            sink, kept = sinks[why]
            problem = None
            if rank == 0:
                base = {"group": label, "tier": info.tier, "ranks": info.ranks, "nodes": info.nodes,
                        "collective": coll.value, "mode": mode.value, "dtype": args.dtype,
                        "bytes": nbytes, "count": count}
                try:
                    sink.append([dict(base, rep=i, time_s=float(t)) for i, t in enumerate(samples)],
                                dict(base, **st, algbw_GBps=algbw, busbw_GBps=busbw, wrong=wrong),
                                {"group": label, "collective": coll.value, "bytes": nbytes, "phase": why,
                                 "wall_s": wall})
                except UserError as e:
                    problem = e
                else:
                    print(_row(nbytes, count, args.dtype, coll, st["median_s"], busbw, wrong) + tag, flush=True)
            _agree(world, problem)  # a failed write (a full disk) stops every rank
            kept[(label, coll.value, nbytes)] = {"median_s": st["median_s"], "ci_lo_s": st["ci_lo_s"],
                                                 "ci_hi_s": st["ci_hi_s"], "wall_s": wall}

        if phase == "random":
            # interleaved over the collectives: a run cut short still judges every collective
            order = interleaved(plan, colls)
            say(f"# {len(order)} random sizes on {label} (tier {info.tier}), mode {mode.value}\n{RANDOM_HEADER}")
            for i, (coll, nbytes_req) in enumerate(order, 1):
                nbytes, _ = align(coll, nbytes_req, info.ranks, args.dtype)
                if (label, coll.value, nbytes) not in stored:
                    measure_size(coll, nbytes, phase, check, tag=f" {coll.value:<14} {f'{i}/{len(order)}':>9}")
        else:
            for ci, coll in enumerate(colls):
                say(f"# [{ci + 1}/{len(colls)}] {coll.value} on {label} (tier {info.tier}), mode {mode.value}, "
                    f"{len(sizes)} sizes", file=sys.stderr)
                say(f"# {coll.value} group {label} tier {info.tier} mode {mode.value}"
                    + (f" (and {len(beside[coll.value])} random sizes into {random_out})" if beside else "")
                    + f"\n{HEADER}")
                notes = set()
                for nbytes_req, why in in_turn(sizes, beside.get(coll.value, [])):
                    nbytes, _ = align(coll, nbytes_req, info.ranks, args.dtype)
                    note = rounded_note(coll, nbytes_req, nbytes, info.ranks)
                    if note and rank == 0 and note not in notes:
                        notes.add(note)
                        print(f"# {note}", file=sys.stderr)
                    if (label, coll.value, nbytes) not in sinks[why][1]:
                        measure_size(coll, nbytes, why, check)
        # every sweep first, then the refinements: a run cut short has every collective's sweep
        if refining:
            done = refine_group(args, say, label, colls, info.ranks, sizes, stored, measure_size, unit)
            _on_root(world, lambda: [rd.write_refine(label, name, record) for name, record in done.items()])
        backend.close()
        comm.Free()
    if check and not checked:
        verdict = "; nothing was checked (every size was measured before: --check checks the sizes a run measures)"
    else:
        verdict = f"; {total_wrong} wrong elements in {checked} checked sizes" if check else ""
    say(f"# results in {out}{verdict}", file=sys.stderr)
    return 1 if total_wrong else 0


def in_turn(sizes: list[int], extra: list[int]) -> list[tuple[int, str]]:
    """The sweep's sizes and the random ones of one collective, in ascending order, each with its phase:
    every random size is measured between the sweep's sizes around it, under the same conditions."""
    return sorted([(n, "sweep") for n in sizes] + [(n, "random") for n in extra])


# the parameters of calibrate.measure.heldout.random_sizes as calibrate run names them
RANDOM_OPTIONS = {"align": "random_align", "min_bytes": "random_min_bytes", "max_bytes": "random_max_bytes"}


def _random_plan(args, colls: list[Collective], world_size: int, max_default: str) -> dict[str, list[int]]:
    lo = parse_size(args.random_min_bytes or args.min_bytes)
    hi = parse_size(args.random_max_bytes or args.max_bytes or max_default)
    try:
        return draw_random_sizes(colls, lo, hi, args.random, args.random_seed,
                                 parse_size(args.random_align) * world_size)
    except OptionError as e:
        name = lambda n: RANDOM_OPTIONS.get(n, n)  # noqa: E731
        raise OptionError(name(e.option), NAME.sub(lambda m: "{" + name(m.group(1)) + "}", e.problem)) from None


def _random_meta(meta: dict, plan: dict[str, list[int]], args, out: str) -> dict:
    """meta.json of the random sizes' directory: the sweep's, with the sizes drawn and how."""
    config = dict(meta["config"], sizes=plan, phase="random",
                  random={"count": args.random, "seed": args.random_seed, "align_per_rank": args.random_align,
                          "measured_with": out})
    config.pop("refine", None)
    return dict(meta, config=config)


def interleaved(plan: dict[str, list[int]], colls: list[Collective]) -> list[tuple[Collective, int]]:
    """(collective, size) pairs: the first size of every collective, then the second, ..."""
    longest = max((len(plan[c.value]) for c in colls), default=0)
    return [(c, plan[c.value][i]) for i in range(longest) for c in colls if i < len(plan[c.value])]


INTERRUPTED = "measured sizes are saved: add --resume to continue"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    return run_mpi_command(lambda: run(args, world), world, "calibrate run", INTERRUPTED, spelled_by(parser))
