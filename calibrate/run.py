"""``python -m calibrate run``: time the collectives over a sweep of sizes,
nccl-tests style, one process per rank (mpiexec or srun)."""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import shlex
import socket
import sys
import traceback
from pathlib import Path

from mpi4py import MPI

from calibrate.backends import REGISTRY as BACKENDS
from calibrate import run_limits
from calibrate.backends import make_backend
from calibrate.backends.base import TimingMode
from calibrate.cli import command_parser
from calibrate.collectives import ALL_COLLECTIVES, Collective, busbw_factor
from calibrate.device.dtypes import dtype_size
from calibrate.errors import UserError
from calibrate.groups import parse_group_kinds, split, topology
from calibrate.results import KIND, SCHEMA_VERSION, ResultsDir
from calibrate.sizes import align, parse_size, rounded_note, sweep
from calibrate.stats import summarize

HEADER = ("#{:>12} {:>12} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}".format(
    "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong")
    + "\n#{:>12} {:>12} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}".format(
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""))


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "python -m calibrate run",
        "Time collectives over a sweep of sizes (one process per GPU or rank, "
        "under mpiexec or srun) and write a resumable results directory.")
    p.add_argument("--backend", default="auto", help="nccl (GPUs, cupy), mpi (host buffers) or auto "
                   "(nccl when a GPU is visible, else mpi). Default: auto")
    p.add_argument("--collectives", "-c", default=",".join(c.value for c in ALL_COLLECTIVES),
                   help="comma-separated: allreduce,allgather,reducescatter,alltoall,broadcast,sendrecv")
    p.add_argument("--min-bytes", "-b", default="1K", help="smallest size (K/M/G suffixes). Default 1K")
    p.add_argument("--max-bytes", "-e", default=None, help="largest size. Default 1G with nccl, 64M with mpi")
    p.add_argument("--factor", "-f", type=float, default=2.0, help="size multiplier between steps. Default 2")
    p.add_argument("--dtype", "-d", default="float32", help="float32, float16, bfloat16 (nccl), float64, int32")
    p.add_argument("--iters", "-n", type=int, default=20, help="calls per timed batch (host, graph) or timed calls (isolated)")
    p.add_argument("--warmup", "-w", type=int, default=5, help="untimed calls before timing each size")
    p.add_argument("--reps", type=int, default=5, help="timed batches per size in host and graph modes")
    p.add_argument("--mode", "-m", default="host", help="host (CPU clock, one sync), graph (CUDA graph, events) "
                   "or isolated (barrier, one call, sync)")
    p.add_argument("--check", action="store_true", help="after timing, check each size on fresh random data; "
                   "exit non-zero if anything is wrong")
    p.add_argument("--groups", default="world,intra,inter",
                   help="groups to measure: world, intra (ranks of one host), inter (one rank per host)")
    p.add_argument("--out", "-o", default=None, help="results directory. Default results/calib-<date>-<time>")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out, skipping what is done")
    return p


def _agree(world, problem: str | None) -> None:
    """Raise the first problem any rank found, on every rank."""
    problems = [m for m in world.allgather(problem) if m]
    if problems:
        raise UserError(problems[0])


def _pick_backend(name: str) -> str:
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


def _check_resources(args, world, colls, sizes, backend_name, hosts, say) -> None:
    """Memory for the largest size on every rank (host memory per host, or the GPU's), before any work;
    a warning when a host has more ranks than cores."""
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
        problem = str(e)
    _agree(world, problem)
    warning = run_limits.oversubscription_warning(sharing, run_limits.cores(), here)
    warnings = [w for w in world.allgather(warning) if w]
    if warnings:
        say(warnings[0], file=sys.stderr)


def run(args, world) -> int:
    rank = world.Get_rank()
    say = (lambda *a, **k: print(*a, **k, flush=True)) if rank == 0 else (lambda *a, **k: None)
    run_limits.check_counts(args.iters, args.warmup, args.reps)
    colls = [Collective.parse(c) for c in args.collectives.split(",") if c.strip()]
    if not colls:
        raise UserError("--collectives is empty: name at least one collective")
    mode = TimingMode.parse(args.mode)
    dtype_size(args.dtype)
    kinds = parse_group_kinds(args.groups)
    backend_name = _pick_backend(args.backend)
    _agree(world, None)  # every rank parsed the same arguments
    if mode is TimingMode.GRAPH and backend_name != "nccl":
        raise UserError("graph timing needs GPUs: use --backend nccl, or --mode host or isolated")
    if args.dtype == "bfloat16" and backend_name != "nccl":
        raise UserError("bfloat16 needs the nccl backend: use --dtype float16 or float32 with mpi")
    max_default = "1G" if backend_name == "nccl" else "64M"
    sizes = sweep(parse_size(args.min_bytes), parse_size(args.max_bytes or max_default), args.factor)
    run_limits.check_world(world.Get_size())

    device = None
    if backend_name == "nccl":
        from calibrate.device.gpu import select_gpu

        device = select_gpu(world)
    _, nnodes, _, hosts = topology(world)
    _check_resources(args, world, colls, sizes, backend_name, hosts, say)
    out = args.out or os.path.join("results", "calib-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    meta = {
        "kind": KIND,
        "version": SCHEMA_VERSION,
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "config": {"backend": backend_name, "mode": mode.value, "dtype": args.dtype, "iters": args.iters,
                   "warmup": args.warmup, "reps": args.reps, "world_size": world.Get_size(),
                   "hosts": sorted(set(hosts)), "collectives": [c.value for c in colls],
                   "sizes": sizes, "groups": kinds},
        "ranks": world.gather({"rank": rank, "host": socket.gethostname(), "device": device}, root=0),
        "nodes": nnodes,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("NCCL_", "COMMTUNE_NCCL_", "SLURM_JOB", "OMPI_COMM_WORLD_SIZE"))},
    }
    rd = ResultsDir(Path(out))
    done, problem = set(), None
    if rank == 0:
        try:
            done = rd.prepare(meta, args.resume)
        except UserError as e:
            problem = str(e)
    _agree(world, problem)
    done = world.bcast(done, root=0)
    if done:
        say(f"# resuming {out}: {len(done)} sizes already measured are skipped", file=sys.stderr)

    total_wrong, versions_written = 0, False
    for kind in kinds:
        comm, info = split(world, kind)
        if comm is None:
            say(f"# group {kind}: groups of one rank ({nnodes} node(s)), nothing to measure", file=sys.stderr)
            continue
        if kind != "world" and info.ranks == world.Get_size():
            say(f"# group {kind}: the same ranks as world, measured once as world", file=sys.stderr)
            comm.Free()
            continue
        backend = make_backend(backend_name, comm, **({"device": device} if device is not None else {}))
        if not versions_written:
            versions = world.gather(backend.versions(), root=0)
            if rank == 0:
                meta["ranks"] = [dict(r, **v) for r, v in zip(meta["ranks"], versions)]
                rd.write_meta(meta)
            versions_written = True
        label = f"{kind}:{info.ranks}x{info.nodes}"
        for ci, coll in enumerate(colls):
            say(f"# [{ci + 1}/{len(colls)}] {coll.value} on {label} (tier {info.tier}), mode {mode.value}, "
                f"{len(sizes)} sizes", file=sys.stderr)
            say(f"# {coll.value} group {label} tier {info.tier} mode {mode.value}\n{HEADER}")
            notes = set()
            for nbytes_req in sizes:
                nbytes, count = align(coll, nbytes_req, info.ranks, args.dtype)
                note = rounded_note(coll, nbytes_req, nbytes, info.ranks)
                if note and rank == 0 and note not in notes:
                    notes.add(note)
                    print(f"# {note}", file=sys.stderr)
                if (label, coll.value, nbytes) in done:
                    continue
                samples = backend.measure(coll, nbytes, args.dtype, args.iters, args.warmup, mode, args.reps)
                world.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)  # concurrent groups: the slowest
                wrong = -1
                if args.check:
                    # each group's check is summed over its ranks: count every group once
                    wrong = world.allreduce(backend.check(coll, nbytes, args.dtype, seed=nbytes),
                                            op=MPI.SUM) // info.ranks
                    total_wrong += max(wrong, 0)
                st = summarize(samples)
                algbw = nbytes / st["median_s"] / 1e9
                busbw = algbw * busbw_factor(coll, info.ranks)
                if rank == 0:
                    base = {"group": label, "tier": info.tier, "ranks": info.ranks, "nodes": info.nodes,
                            "collective": coll.value, "mode": mode.value, "dtype": args.dtype,
                            "bytes": nbytes, "count": count}
                    rd.append([dict(base, rep=i, time_s=float(t)) for i, t in enumerate(samples)],
                              dict(base, **st, algbw_GBps=algbw, busbw_GBps=busbw, wrong=wrong))
                    print(_row(nbytes, count, args.dtype, coll, st["median_s"], busbw, wrong), flush=True)
                done.add((label, coll.value, nbytes))
        backend.close()
        comm.Free()
    say(f"# results in {out}" + (f"; {total_wrong} wrong elements" if args.check else ""), file=sys.stderr)
    return 1 if total_wrong else 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    world = MPI.COMM_WORLD
    try:
        return run(args, world)
    except UserError as e:
        if world.Get_rank() == 0:
            print(f"calibrate run: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("calibrate run: interrupted; measured sizes are saved: add --resume to continue", file=sys.stderr)
        world.Abort(130)
    except Exception:  # noqa: BLE001  (one rank failing must not leave the others hanging)
        traceback.print_exc()
        world.Abort(1)
    return 1
