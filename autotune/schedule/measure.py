"""Measure the selected candidates beside NCCL on GPUs, with the interpreter's own
runtime and timing code (one process per GPU, under mpirun).

Per band, at its size: fresh random input; NCCL's result as the reference; each
selected candidate is served through the interpreter's selection
(``kernels.interp.select.choose`` on its entry alone, exactly what the tuned
manifest will do) into a poisoned output and compared with NCCL's on every rank;
then every correct candidate and NCCL are captured as CUDA graphs of N calls and
replayed in turn, timed with CUDA events (``kernels.interp.gpudata``, as
``python -m kernels bench``); the median replay, maximum over ranks, is kept.
Calls are out of place, like NCCL's and the benchmark's.
"""
from __future__ import annotations

import math
import statistics

from calibrate.errors import UserError
from kernels.interp import bench, gpudata, pack
from kernels.interp.select import choose

from autotune.schedule.outputs import entry_for
from autotune.schedule.result import NCCL, BandResult
from autotune.schedule.space import Built


def gpu_world(ranks: int):
    """(MPI world, cupy, None) when this run can measure ``ranks`` ranks, else (None, None, reason)."""
    try:
        import cupy as cp
    except ImportError:
        return None, None, "cupy is not installed (no GPU here)"
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # cupy raises its CUDA runtime error when there is no driver or device
        return None, None, f"no usable GPU ({e})"
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size == 1 and ranks > 1:
        return None, None, f"this is one process; run under mpirun -np {ranks}, one process per GPU, to measure"
    if world.size != ranks:
        raise UserError(f"running as {world.size} MPI processes but --gpus is {ranks}; start mpirun -np {ranks}")
    local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    if n <= local:
        raise UserError(f"local rank {local} has no GPU ({n} visible); start one process per GPU")
    cp.cuda.Device(local).use()
    return world, cp, None


def device_name(cp) -> str:
    return cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()


def load_programs(comm, built: list[Built]) -> None:
    seen = set()
    for b in built:
        if id(b.program) not in seen:
            comm.load(entry_for(b.candidate, b.program.name), b.program)
            seen.add(id(b.program))


def band_count(collective: str, nbytes: int, esize: int, nranks: int, built: list[Built]) -> int:
    """NCCL's count for the band's size, rounded down to what every program can split (at least one step)."""
    step = math.lcm(*[pack.min_count(b.program, nranks) for b in built]) if built else 1
    count = bench.count_for(collective, nbytes, esize, nranks)
    return max(step, count // step * step)


def measure_band(comm, cp, stream, collective: str, band: BandResult, built: dict[str, Built], dtype: str,
                 reps: int, seed: int) -> None:
    """Fill measured_us / correct / skipped of the selected rows of ``band`` and its NCCL time."""
    from mpi4py import MPI

    rank, nranks, esize = comm.rank, comm.nranks, pack.DTYPES[dtype]
    rows = [r for r in band.rows if r.selected]
    count = band_count(collective, band.rep, esize, nranks, [built[r.key] for r in rows])
    in_n, out_n = pack.buffer_elems(collective, count, nranks)
    send = gpudata.empty(cp, dtype, in_n)
    ours, ref = gpudata.empty(cp, dtype, out_n), gpudata.empty(cp, dtype, out_n)
    gpudata.fill_random(cp, send, dtype, seed=1000 * rank + seed)
    gpudata.poison(ref, dtype)
    cp.cuda.Device().synchronize()
    with stream:
        comm.nccl_collective(collective, send.data.ptr, ref.data.ptr, count, dtype, stream)
    stream.synchronize()
    choices = {}
    for r in rows:
        b = built[r.key]
        choice = choose([(entry_for(b.candidate, b.program.name), b.program)], collective, count, dtype, nranks,
                        comm.preset.max_split)
        if choice.uses_nccl:
            r.skipped = choice.reason
            continue
        r.split = choice.split
        gpudata.poison(ours, dtype)
        cp.cuda.Device().synchronize()
        try:
            with stream:
                comm.collective(collective, send, ours, count, dtype, stream=stream, choice=choice)
            stream.synchronize()
        except UserError as e:      # the same on every rank: raised before any launch
            r.skipped = str(e)
            continue
        ok, err = gpudata.compare(cp, ours, ref, dtype, out_n)
        r.correct = bool(comm.mpi.allreduce(int(ok), op=MPI.MIN))
        r.max_rel_err = float(comm.mpi.allreduce(err, op=MPI.MAX))
        if r.correct:
            choices[r.key] = choice
    n = bench.ncalls_for(band.rep)
    with stream:
        graphs = {key: gpudata.capture(stream, lambda s, c=c: comm.collective(collective, send, ours, count, dtype,
                                                                               stream=s, choice=c), n)
                  for key, c in choices.items()}
        graphs[NCCL] = gpudata.capture(stream, lambda s: comm.nccl_collective(collective, send.data.ptr,
                                                                              ref.data.ptr, count, dtype, s), n)
    times = gpudata.time_graphs(cp, comm.mpi, stream, graphs, n, reps)
    for key, ts in times.items():
        t = float(comm.mpi.allreduce(statistics.median(ts), op=MPI.MAX)) * 1e6
        if key == NCCL:
            band.nccl_measured_us = t
        else:
            band.row(key).measured_us = t
    del graphs, send, ours, ref
    cp.get_default_memory_pool().free_all_blocks()


def measure(comm, cp, collective: str, bands: list[BandResult], built: dict[str, Built], dtype: str, reps: int,
            progress=None) -> None:
    load_programs(comm, [built[r.key] for b in bands for r in b.rows if r.selected])
    stream = cp.cuda.Stream(non_blocking=True)
    for i, band in enumerate(bands):
        measure_band(comm, cp, stream, collective, band, built, dtype, reps, seed=i)
        if progress:
            done = band.measured_rows()
            best = min(done, key=lambda r: r.measured_us) if done else None
            wrong = sum(r.correct is False for r in band.rows)
            progress(f"measured band {i + 1}/{len(bands)} at {band.rep} B: {len(done)} candidates"
                     + (f", best {best.key} {best.measured_us:.1f} us" if best else "")
                     + f", NCCL {band.nccl_measured_us:.1f} us" + (f", {wrong} WRONG" if wrong else ""))
