"""A step's GPU trace as plain intervals (pure Python: no torch): which device
activities are communication, which keep the GPU busy otherwise, how long
communication runs with nothing else running (the exposed part), and where the
device time goes, by kernel family.

The torch profiler lists, besides the kernels, memory copies and sets, *GPU user
annotations*: ``record_function`` ranges projected onto the GPU timeline (for
example ``nccl:all_reduce`` around each NCCL kernel, or a whole step). They have
the device type of the GPU, but they are labels, not work: counting them as busy
time covered every NCCL kernel by its own label and measured no exposed
communication at all. Only real activities (``annotation`` false) count here.
"""
from __future__ import annotations

from dataclasses import dataclass

NCCL = ("ncclDevKernel", "ncclKernel")
FAMILIES = (  # (family, substrings of the kernel name), first match wins
    ("nccl", NCCL),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
    ("softmax", ("softmax",)),
    ("reduce", ("reduce_kernel", "reduce", "norm")),
    ("copy", ("memcpy", "memset", "copy", "cat", "fill")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


@dataclass(frozen=True)
class DeviceEvent:
    """One activity on this process's GPU, times in microseconds."""

    name: str
    start: float
    end: float
    annotation: bool = False  # a GPU user annotation (a label), not work


def is_comm(name: str) -> bool:
    return name.startswith(NCCL)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "other"


def split(events: list[DeviceEvent]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(communication intervals, other busy intervals); annotations dropped."""
    comm, busy = [], []
    for e in events:
        if e.annotation or e.end <= e.start:
            continue
        (comm if is_comm(e.name) else busy).append((e.start, e.end))
    return comm, busy


def union(intervals) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def exposed_time(comm, compute) -> float:
    """Length of the time covered by a ``comm`` interval and by no ``compute`` interval."""
    total, busy = 0.0, union(compute)
    for a, b in union(comm):
        covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy if x < b and y > a)
        total += (b - a) - covered
    return total


def idle_time(events: list[DeviceEvent]) -> float:
    """Time between the first and the last activity during which the GPU runs nothing (annotations
    left out): the device waiting for the host to issue work, or for the loss's sync."""
    busy = union((e.start, e.end) for e in events if not e.annotation and e.end > e.start)
    if not busy:
        return 0.0
    return (busy[-1][1] - busy[0][0]) - sum(b - a for a, b in busy)


def breakdown(events: list[DeviceEvent], steps: int) -> dict:
    """Device time per step (seconds) by kernel family, annotations left out."""
    out: dict[str, float] = {}
    for e in events:
        if not e.annotation and e.end > e.start:
            fam = family(e.name)
            out[fam] = out.get(fam, 0.0) + (e.end - e.start) / 1e6 / max(steps, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def top_kernels(events: list[DeviceEvent], steps: int, n: int = 25) -> list[dict]:
    """The ``n`` kernels with the most device time per step: name, seconds per step, calls per step."""
    acc: dict[str, list[float]] = {}
    for e in events:
        if not e.annotation and e.end > e.start:
            a = acc.setdefault(e.name[:120], [0.0, 0])
            a[0] += e.end - e.start
            a[1] += 1
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": k, "s": v[0] / 1e6 / max(steps, 1), "calls": v[1] / max(steps, 1)} for k, v in rows]
