"""The interpreter and NCCL side by side (``python -m kernels bench``; the command is
``kernels.interp.cli.bench``), under ``mpirun -np N`` (one process per GPU).

For each collective and size (nccl-tests' "size": the whole buffer) both are arms
of the measurement engine (``calibrate.measure.engine``) on the same input buffer,
each a CUDA graph of N calls timed with CUDA events, interleaved replay by replay;
each result is checked on fresh random data with its output poisoned, against the
reference computed from every rank's input, before timing and after the timed
replays. ``table`` is an
nccl-tests-style table with a speedup column; ``records.BenchRecord`` the result.
"""
from __future__ import annotations

import sys

from calibrate.collectives import Collective, busbw_factor
from calibrate.errors import UserError
from calibrate.measure import engine
from calibrate.sizes import sweep

from kernels.interp import gpudata, pack

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "alltoall")


def count_for(collective: str, nbytes: int, esize: int, nranks: int) -> int:
    """NCCL's count for a call whose whole buffer is ``nbytes``."""
    elems = nbytes // esize
    return elems // nranks if collective in ("allgather", "reducescatter") else elems


def ncalls_for(nbytes: int) -> int:
    """Calls per graph: about 20 ms of work per replay at large sizes, 200 calls at small ones."""
    return int(min(200, max(5, (20e-3 * 300e9) // max(nbytes, 1))))


def run(args, comm) -> list[dict]:
    import cupy as cp

    rank, nranks = comm.rank, comm.nranks
    dtype, esize = args.dtype, pack.DTYPES[args.dtype]
    colls = [c.strip() for c in args.collectives.split(",") if c.strip()]
    for c in colls:
        if c not in COLLECTIVES:
            raise UserError(f"unknown collective {c!r}; use some of {', '.join(COLLECTIVES)}")
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for coll in colls:
        for nbytes in sweep(args.min_bytes, args.max_bytes, args.factor):
            count = count_for(coll, nbytes, esize, nranks)
            if count == 0:
                continue
            choice = comm.prepare(coll, count, dtype)
            if args.explain and rank == 0:
                print("explain:", choice.reason, file=sys.stderr)
            row = measure(comm, coll, nbytes, dtype, choice, args.reps, stream)
            rows.append(row)
            if rank == 0:
                print(line(row), file=sys.stderr, flush=True)
    return rows


def compare_choices(comm, coll: str, nbytes: int, dtype: str, choices: dict, reps: int, stream, seed: int = 0):
    """An engine comparison (``calibrate.measure.engine.Comparison``) of named launches of one size on
    one input buffer, each with its own output: a ``Choice`` of the interpreter (a program launch, or
    its NCCL fallback), None for NCCL called directly, an exception (the arm cannot run: its row
    says why), or a factory of an engine arm with buffers of its own (e.g. NCCL on another
    communicator; its error is NaN). Each arm is checked against the reference
    computed from every rank's seeded input before timing and again after its timed replays (FIFO
    credits and LL flags reused); CUDA graphs of ``ncalls_for`` calls, ``reps`` replays interleaved
    arm by arm, median, maximum over ranks. Returns (comparison, {name: the arm's largest relative
    error over ranks})."""
    import cupy as cp

    rank, nranks = comm.rank, comm.nranks
    count = count_for(coll, nbytes, pack.DTYPES[dtype], nranks)
    in_n, out_n = pack.buffer_elems(coll, count, nranks)
    send = gpudata.empty(cp, dtype, in_n)
    gpudata.fill_random(cp, send, dtype, seed=1000 * rank + seed)
    made: dict[str, gpudata.LaunchArm] = {}

    def arm(name, choice):
        if callable(choice):                      # an arm of its own, made as it is
            return choice

        def make():
            if isinstance(choice, Exception):     # an arm that cannot run here: a row saying why
                raise choice
            out = gpudata.empty(cp, dtype, out_n)
            if choice is None:
                def launch(s):
                    comm.nccl_collective(coll, send.data.ptr, out.data.ptr, count, dtype, s)
            else:
                def launch(s):
                    comm.collective(coll, send, out, count, dtype, stream=s, choice=choice)
            made[name] = gpudata.LaunchArm(cp, stream, launch, send, out.data.ptr, out_n, coll, count, dtype, rank,
                                           nranks, out)
            return made[name]
        return make

    opts = engine.Options(engine.TimingMode.GRAPH, rounds=reps, calls=ncalls_for(nbytes), min_batch_s=0.0, warmup=2,
                          seed=seed)
    res = engine.compare(engine.MpiGroup(comm.mpi), [(name, arm(name, c)) for name, c in choices.items()], opts)
    errs = {name: float(max(comm.mpi.allgather(a.max_rel_err if a is not None else float("nan"))))
            for name, a in ((n, made.get(n)) for n in choices)}
    del send, made
    cp.get_default_memory_pool().free_all_blocks()
    return res, errs


def measure(comm, coll: str, nbytes: int, dtype: str, choice, reps: int, stream) -> dict:
    """One row: ``choice`` (a program launch, or NCCL) and NCCL compared (``compare_choices``)."""
    res, errs = compare_choices(comm, coll, nbytes, dtype, {"interp": choice, "nccl": None}, reps, stream,
                                seed=nbytes % 997 + choice.split)
    i, r = res["interp"], res["nccl"]
    t_i = i.median_s if i.median_s is not None else float("nan")
    t_n = r.median_s if r.median_s is not None else float("nan")
    f = busbw_factor(Collective.parse(coll), comm.nranks)
    return {"collective": coll, "bytes": nbytes, "count": count_for(coll, nbytes, pack.DTYPES[dtype], comm.nranks),
            "dtype": dtype, "program": "nccl" if choice.uses_nccl else choice.program.name,
            "protocol": choice.protocol.value if choice.protocol else "", "split": choice.split,
            "calls_per_graph": i.calls or ncalls_for(nbytes), "interp_us": t_i * 1e6, "nccl_us": t_n * 1e6,
            "interp_busbw_gbs": nbytes / t_i * f / 1e9, "nccl_busbw_gbs": nbytes / t_n * f / 1e9,
            "speedup": t_n / t_i, "correct": i.ok, "max_rel_err": errs["interp"],
            "checked": "before timing and after the timed replays", "nccl_correct": r.ok,
            "wrong_before": i.wrong_before, "wrong_after": i.wrong_after, "why": i.reason or r.reason}


HEADER = (f"{'collective':>13} {'bytes':>11} {'program':>24} {'proto':>6} {'split':>5} {'interp us':>10} "
          f"{'nccl us':>9} {'interp GB/s':>11} {'nccl GB/s':>9} {'speedup':>7} {'ok':>3}")


def line(r: dict) -> str:
    return (f"{r['collective']:>13} {r['bytes']:>11} {r['program']:>24} {r['protocol']:>6} {r['split']:>5} "
            f"{r['interp_us']:>10.2f} {r['nccl_us']:>9.2f} {r['interp_busbw_gbs']:>11.1f} "
            f"{r['nccl_busbw_gbs']:>9.1f} {r['speedup']:>7.2f} {'yes' if r['correct'] else 'NO':>3}")


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER] + [line(r) for r in rows])
