"""Measure the selected candidates beside NCCL on GPUs, with the interpreter's own
runtime and benchmark (one process per GPU, under mpirun).

Per band, at its size, each selected candidate is served through the
interpreter's selection (``kernels.interp.select.choose`` on its entry alone,
exactly what the tuned manifest will do) and handed to
``kernels.interp.bench.measure`` (the measurement engine): fresh random input,
output poisoned, result checked against the reference on every rank before timing
and after the timed replays, the candidate and NCCL captured as CUDA graphs of N
calls, replays interleaved and timed with CUDA events; median replay, maximum over
ranks. The band's NCCL time is the median of NCCL's times
beside its candidates. Calls are out of place, like NCCL's and the benchmark's.
These are development figures (the best of the candidates against that median):
``python -m autotune schedule evaluate`` gives the ones to quote.
"""
from __future__ import annotations

from calibrate.device.gpu import device_name as gpu_name
from calibrate.device.gpu import select_gpu
from calibrate.errors import OptionError, UserError
from calibrate.measure.stats import median
from kernels.interp import bench, pack
from kernels.interp.select import choose

from autotune.schedule.outputs import entry_for
from autotune.schedule.result import BandResult
from autotune.schedule.space import Built


def gpu_world(ranks: int):
    """(MPI world, cupy, None) when this run can measure ``ranks`` ranks, else (None, None, reason)."""
    try:
        import cupy as cp
    except ImportError:
        return None, None, "cupy is not installed (no GPU here)"
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # cupy raises its CUDA runtime error when there is no driver or device
        return None, None, f"no usable GPU ({e})"
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size == 1 and ranks > 1:
        return None, None, f"this is one process; run under mpirun -np {ranks}, one process per GPU, to measure"
    if world.size != ranks:
        raise OptionError("gpus", f"is {ranks} but this runs as {world.size} MPI processes: start mpirun -np {ranks}")
    select_gpu(world, needs="measuring candidates", fallback="run it on a GPU machine")
    return world, cp, None


def device_name(cp) -> str:
    return gpu_name(cp, cp.cuda.Device().id)


def load_programs(comm, built: list[Built]) -> None:
    seen = set()
    for b in built:
        if id(b.program) not in seen:
            comm.load(entry_for(b.candidate, b.program.name), b.program)
            seen.add(id(b.program))


def measure_band(comm, collective: str, band: BandResult, built: dict[str, Built], dtype: str, reps: int,
                 stream) -> None:
    """Fill measured_us / correct / skipped of the selected rows of ``band`` and its NCCL time
    (the median of NCCL's times measured beside each candidate)."""
    nranks, esize = comm.nranks, pack.DTYPES[dtype]
    count = bench.count_for(collective, band.rep, esize, nranks)
    nccl_us = []
    for r in (r for r in band.rows if r.selected):
        b = built[r.key]
        choice = choose([(entry_for(b.candidate, b.program.name), b.program)], collective, count, dtype, nranks,
                        comm.preset.max_split)
        if choice.uses_nccl:
            r.skipped = choice.reason
            continue
        try:
            row = bench.measure(comm, collective, band.rep, dtype, choice, reps, stream)
        except UserError as e:      # the same on every rank: raised before any launch
            r.skipped = str(e)
            continue
        r.split, r.correct = choice.split, bool(row["correct"])
        r.max_rel_err = float(comm.mpi.allreduce(row["max_rel_err"], op=_mpi_max()))
        if r.correct:
            r.measured_us = row["interp_us"]
        nccl_us.append(row["nccl_us"])
    if nccl_us:
        band.nccl_measured_us = median(nccl_us)


def _mpi_max():
    from mpi4py import MPI

    return MPI.MAX


def measure(comm, cp, collective: str, bands: list[BandResult], built: dict[str, Built], dtype: str, reps: int,
            progress=None) -> None:
    load_programs(comm, [built[r.key] for b in bands for r in b.rows if r.selected])
    stream = cp.cuda.Stream(non_blocking=True)
    for i, band in enumerate(bands):
        measure_band(comm, collective, band, built, dtype, reps, stream)
        if progress:
            done = band.measured_rows()
            best = min(done, key=lambda r: r.measured_us) if done else None
            wrong = sum(r.correct is False for r in band.rows)
            progress(f"measured band {i + 1}/{len(bands)} at {band.rep} B: {len(done)} candidates"
                     + (f", best {best.key} {best.measured_us:.1f} us" if best else "")
                     + (f", NCCL {band.nccl_measured_us:.1f} us" if band.nccl_measured_us else "")
                     + (f", {wrong} WRONG" if wrong else ""))
