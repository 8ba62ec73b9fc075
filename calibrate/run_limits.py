"""Limits of ``python -m calibrate run`` checked before anything is measured or
written: counts, the rank count, memory for the largest size, and cores."""
from __future__ import annotations

import os

from calibrate.backends.base import buffer_lengths
from calibrate.collectives import Collective
from calibrate.device.dtypes import dtype_size
from calibrate.errors import OptionError, UserError

# buffers of one size: send and receive, and as much again for --check's inputs and references
CHECK_FACTOR = 2


# calls of one size (warm-up and timed) beyond which a run is refused: a million calls at the fastest
# collective's few microseconds is already seconds per size, times every size, collective and group
MAX_CALLS_PER_SIZE = 1_000_000
FASTEST_CALL_S = 2e-6


def check_counts(iters: int, warmup: int, reps: int, sizes: int = 1) -> None:
    """The counts of calls in range, and their work bounded (``sizes``: sizes times collectives
    measured), before any work."""
    if iters < 1:
        raise OptionError("iters", f"must be >= 1, got {iters}")
    if warmup < 0:
        raise OptionError("warmup", f"must be >= 0, got {warmup}")
    if reps < 1:
        raise OptionError("reps", f"must be >= 1, got {reps}")
    calls = warmup + iters * reps
    if calls > MAX_CALLS_PER_SIZE:
        seconds = calls * max(sizes, 1) * FASTEST_CALL_S
        raise OptionError("iters", f"{iters} x {{reps}} {reps} + {{warmup}} {warmup} is {calls:,} calls per size, "
                                   f"at least {seconds:,.0f} s for {max(sizes, 1)} size(s) at "
                                   f"{FASTEST_CALL_S * 1e6:.0f} us a call: at most {MAX_CALLS_PER_SIZE:,} calls "
                                   f"per size")


def check_world(size: int) -> None:
    if size < 2:
        raise UserError("one rank has nothing to measure (every collective needs two or more): "
                        "run under mpiexec -n 2 (or more), or srun with two or more tasks")


def buffer_bytes(colls: list[Collective], nbytes: int, dtype: str, ranks: int, check: bool) -> int:
    """Bytes one rank allocates for the largest of ``colls`` at ``nbytes``."""
    count = nbytes // dtype_size(dtype)
    need = max(sum(buffer_lengths(c, count, ranks)) for c in colls) * dtype_size(dtype)
    return need * (CHECK_FACTOR if check else 1)


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of ``meminfo`` (Linux's /proc/meminfo), else free physical pages; None if unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(need_per_rank: int, ranks_sharing: int, available: int | None, where: str, fix: str) -> None:
    """Refuse a sweep whose largest size needs more than ``available`` bytes for ``ranks_sharing`` ranks."""
    if available is None:
        return
    need = need_per_rank * ranks_sharing
    if need > available:
        raise UserError(f"the largest size needs {need_per_rank / 2**30:.3g} GiB of buffers per rank "
                        f"({ranks_sharing} rank(s) on {where}: {need / 2**30:.3g} GiB) but {where} has "
                        f"{available / 2**30:.3g} GiB available: {fix}")


def cores() -> set[int]:
    """The cores this process may run on (its affinity; every core where the OS has none)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:
        return set(range(os.cpu_count() or 1))


def host_cores(affinities) -> int:
    """Cores the ranks of one host may use together: the union of their affinities. A launcher
    that binds each rank to its own core (Open MPI's mpirun does) gives one core per rank, which
    is no oversubscription; ranks left unbound each see every core, which counts once."""
    return len(set().union(*affinities))


def oversubscription_warning(ranks_on_host: int, ncores: int, host: str) -> str | None:
    if ranks_on_host > ncores:
        return (f"warning: {ranks_on_host} ranks share the {ncores} core(s) of {host}: ranks wait for a core, "
                f"so times are inflated and noisy; run at most {ncores} ranks per host")
    return None
