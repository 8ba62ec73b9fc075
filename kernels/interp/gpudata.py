"""GPU-side helpers shared by the benchmark and the GPU check: fresh random data,
poisoned outputs, comparison with NCCL's result or a local reference, ``StreamArm``: a
launch on a stream as an arm of the measurement engine (``calibrate.measure.engine``), and
``LaunchArm``: such a launch of a collective, with its check."""
from __future__ import annotations

import numpy as np

from calibrate.device.dtypes import tolerance
from calibrate.device.timing import capture, time_graph
from calibrate.measure.engine import Arm

POISON = {"float32": 0xFFFFFFFF, "bfloat16": 0xFFFF, "float16": 0xFFFF}   # NaN bit patterns
STORAGE = {"float32": "uint32", "bfloat16": "uint16", "float16": "uint16"}


def empty(cp, dtype: str, n: int):
    """A device buffer of ``n`` elements held as raw bits (CuPy has no bfloat16)."""
    return cp.empty(max(n, 1), dtype=STORAGE[dtype])


def fill_random(cp, buf, dtype: str, seed: int) -> None:
    """Fresh standard-normal values (never zeros), rounded to ``dtype``."""
    rs = cp.random.RandomState(seed)
    x = rs.standard_normal(buf.size, dtype=cp.float32)
    if dtype == "float32":
        buf[...] = x.view(cp.uint32)
    elif dtype == "float16":
        buf[...] = x.astype(cp.float16).view(cp.uint16)
    else:
        bits = x.view(cp.uint32)
        buf[...] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cp.uint16)


def poison(buf, dtype: str) -> None:
    buf.fill(POISON[dtype])


def as_float(cp, buf, dtype: str):
    if dtype == "float32":
        return buf.view(cp.float32)
    if dtype == "float16":
        return buf.view(cp.float16).astype(cp.float32)
    return (buf.astype(cp.uint32) << 16).view(cp.float32)


def compare(cp, got, want, dtype: str, n: int, nranks: int) -> tuple[bool, float]:
    """(equal within rounding of a sum over ``nranks`` and fully written, max relative error) over the
    first ``n`` elements."""
    g, w = as_float(cp, got[:n], dtype), as_float(cp, want[:n], dtype)
    if not bool(cp.isfinite(w).all()):
        return False, float("nan")
    err = cp.abs(g - w) / (cp.abs(w) + 1e-3)
    bad = ~cp.isfinite(g) | (err > tolerance(dtype, nranks))
    return not bool(bad.any()), float(cp.nan_to_num(err, nan=np.inf).max()) if n else 0.0


def view(cp, ptr: int, n: int, dtype: str, owner=None):
    """A cupy array over ``n`` elements at device address ``ptr`` (memory owned elsewhere)."""
    nbytes = max(n, 1) * np.dtype(STORAGE[dtype]).itemsize
    mem = cp.cuda.UnownedMemory(ptr, nbytes, owner)
    return cp.ndarray((max(n, 1),), dtype=STORAGE[dtype], memptr=cp.cuda.MemoryPointer(mem, 0))


def reference(cp, collective: str, dtype: str, count: int, rank: int, nranks: int, seed: int):
    """(this rank's input, the expected output in float32, the scale of its rounding error) for a
    call on fresh random inputs: every rank draws every rank's input from the same seeds, so the
    result is computed here, independently of any library."""
    in_n = count if collective in ("allreduce", "allgather") else count * nranks
    xs = []
    for r in range(nranks):
        x = empty(cp, dtype, in_n)
        fill_random(cp, x, dtype, seed + 7919 * r)
        xs.append(x)
    f = [as_float(cp, x[:in_n], dtype) for x in xs]
    if collective == "allgather":
        want = cp.concatenate(f)
        return xs[rank], want, cp.abs(want)
    if collective == "reducescatter":
        f = [v[rank * count:(rank + 1) * count] for v in f]
    want, scale = cp.zeros_like(f[0]), cp.zeros_like(f[0])
    for v in f:
        want += v
        scale += cp.abs(v)
    return xs[rank], want, scale


def count_wrong(cp, got, want, scale, dtype: str, nranks: int) -> tuple[int, float]:
    """(elements not written or beyond rounding of ``want``, the largest error relative to ``scale``)."""
    n = want.size
    g = as_float(cp, got[:n], dtype)
    err = cp.abs(g - want) / (scale + 1e-30)
    bad = ~cp.isfinite(g) | (err > tolerance(dtype, nranks))
    return int(cp.count_nonzero(bad)), float(cp.nan_to_num(err, nan=np.inf).max()) if n else 0.0


class StreamArm(Arm):
    """A launch on a CuPy stream as an arm of ``calibrate.measure.engine.compare``: ``launch(stream)``
    issues the work; a batch is ``calls`` launches captured once in a CUDA graph, each replay timed
    by events. It has no check of its own (``LaunchArm`` adds one for a collective)."""

    def __init__(self, cp, stream, launch):
        self.cp, self.stream, self.launch = cp, stream, launch

    def call(self) -> None:
        with self.stream:
            self.launch(self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def graph(self, calls: int):
        with self.stream:
            g = capture(self.stream, self.launch, calls)
        return lambda: time_graph(self.cp, self.stream, g, calls) * calls


class LaunchArm(StreamArm):
    """A collective launched on a CuPy stream (``StreamArm``): ``launch(stream)`` reads ``send`` and
    writes the output at ``out_ptr`` (``out_n`` elements); its check draws every rank's input from
    the seed (``reference``), poisons the output, launches once and counts the wrong elements
    against the reference computed here (no library in it)."""

    def __init__(self, cp, stream, launch, send, out_ptr: int, out_n: int, collective: str, count: int,
                 dtype: str, rank: int, nranks: int, owner=None):
        super().__init__(cp, stream, launch)
        self.send, self.out_ptr, self.out_n = send, out_ptr, out_n
        self.collective, self.count, self.dtype, self.rank, self.nranks = collective, count, dtype, rank, nranks
        self.owner, self.max_rel_err = owner, 0.0

    def check(self, seed: int) -> int:
        cp = self.cp
        mine, want, scale = reference(cp, self.collective, self.dtype, self.count, self.rank, self.nranks, seed)
        out = view(cp, self.out_ptr, self.out_n, self.dtype, self.owner)
        with self.stream:
            self.send[:mine.size] = mine
            poison(out, self.dtype)
        self.call()
        self.synchronize()
        wrong, err = count_wrong(cp, out, want, scale, self.dtype, self.nranks)
        self.max_rel_err = max(self.max_rel_err, err)
        return wrong
