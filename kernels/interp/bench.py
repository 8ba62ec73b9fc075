"""The interpreter and NCCL side by side (``python -m kernels bench``; the command is
``kernels.interp.cli.bench``), under ``mpirun -np N`` (one process per GPU).

For each collective and size (nccl-tests' "size": the whole buffer) both run on
the same buffers, each as a CUDA graph of N calls timed with CUDA events,
interleaved replay by replay; before timing, each result is checked against
NCCL's on fresh random data with the outputs poisoned. ``table`` is an
nccl-tests-style table with a speedup column; ``records.BenchRecord`` the result.
"""
from __future__ import annotations

import statistics
import sys

from calibrate.collectives import Collective, busbw_factor
from calibrate.device.timing import capture, time_graphs
from calibrate.errors import UserError
from calibrate.sizes import sweep

from kernels.interp import gpudata, pack
from kernels.interp.records import BenchRecord

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


def measure(comm, coll: str, nbytes: int, dtype: str, choice, reps: int, stream) -> dict:
    """One row: ``choice`` (a program launch, or NCCL) and NCCL on the same buffers, checked
    against NCCL on fresh random data, then both timed as CUDA graphs, replays interleaved."""
    import cupy as cp

    rank, nranks = comm.rank, comm.nranks
    count = count_for(coll, nbytes, pack.DTYPES[dtype], nranks)
    in_n, out_n = pack.buffer_elems(coll, count, nranks)
    send = gpudata.empty(cp, dtype, in_n)
    ours, ref = gpudata.empty(cp, dtype, out_n), gpudata.empty(cp, dtype, out_n)
    gpudata.fill_random(cp, send, dtype, seed=1000 * rank + nbytes % 997 + choice.split)
    gpudata.poison(ours, dtype)
    gpudata.poison(ref, dtype)
    with stream:
        comm.collective(coll, send, ours, count, dtype, stream=stream, choice=choice)
        comm.nccl_collective(coll, send.data.ptr, ref.data.ptr, count, dtype, stream)
    stream.synchronize()
    ok, err = gpudata.compare(cp, ours, ref, dtype, out_n, nranks)
    ok = bool(comm.mpi.allreduce(int(ok), op=_mpi_min()))
    n = ncalls_for(nbytes)
    with stream:
        graphs = {
            "interp": capture(stream, lambda s: comm.collective(coll, send, ours, count, dtype, stream=s,
                                                                choice=choice), n),
            "nccl": capture(stream, lambda s: comm.nccl_collective(coll, send.data.ptr, ref.data.ptr, count,
                                                                   dtype, s), n),
        }
    times = time_graphs(cp, stream, graphs, n, reps, comm.mpi.Barrier)
    t_i, t_n = statistics.median(times["interp"]), statistics.median(times["nccl"])
    t_i, t_n = comm.mpi.allreduce(t_i, op=_mpi_max()), comm.mpi.allreduce(t_n, op=_mpi_max())
    f = busbw_factor(Collective.parse(coll), nranks)
    row = {"collective": coll, "bytes": nbytes, "count": count, "dtype": dtype,
           "program": "nccl" if choice.uses_nccl else choice.program.name,
           "protocol": choice.protocol.value if choice.protocol else "", "split": choice.split,
           "calls_per_graph": n, "interp_us": t_i * 1e6, "nccl_us": t_n * 1e6,
           "interp_busbw_gbs": nbytes / t_i * f / 1e9, "nccl_busbw_gbs": nbytes / t_n * f / 1e9,
           "speedup": t_n / t_i, "correct": ok, "max_rel_err": err}
    del graphs, send, ours, ref
    cp.get_default_memory_pool().free_all_blocks()
    return row


def _mpi_min():
    from mpi4py import MPI
    return MPI.MIN


def _mpi_max():
    from mpi4py import MPI
    return MPI.MAX


HEADER = (f"{'collective':>13} {'bytes':>11} {'program':>24} {'proto':>6} {'split':>5} {'interp us':>10} "
          f"{'nccl us':>9} {'interp GB/s':>11} {'nccl GB/s':>9} {'speedup':>7} {'ok':>3}")


def line(r: dict) -> str:
    return (f"{r['collective']:>13} {r['bytes']:>11} {r['program']:>24} {r['protocol']:>6} {r['split']:>5} "
            f"{r['interp_us']:>10.2f} {r['nccl_us']:>9.2f} {r['interp_busbw_gbs']:>11.1f} "
            f"{r['nccl_busbw_gbs']:>9.1f} {r['speedup']:>7.2f} {'yes' if r['correct'] else 'NO':>3}")


def table(rows: list[dict]) -> str:
    return "\n".join([HEADER] + [line(r) for r in rows])


def result_json(rows: list[dict], device: str, nranks: int, preset: str) -> dict:
    return BenchRecord(device, nranks, preset, rows).to_dict()
