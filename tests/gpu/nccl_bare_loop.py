"""A bare loop of cupy.cuda.nccl calls, timed as nccl-tests does, to check that
``python -m calibrate run`` adds no overhead: run under ``mpirun -np 2`` in the
same device call as the harness, then compare (``--compare RESULTS_DIR ...``).

    mpirun -np 2 python3 tests/gpu/nccl_bare_loop.py OUT.csv
    python3 tests/gpu/nccl_bare_loop.py --compare OUT.csv RESULTS_DIR [RESULTS_DIR ...]
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np


def measure(out_csv: str, min_bytes=1 << 10, max_bytes=1 << 30, iters=20, reps=5) -> None:
    import cupy as cp
    from cupy.cuda import nccl
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cp.cuda.Device(local).use()
    uid = world.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
    comm = nccl.NcclCommunicator(p, uid, rank)
    stream = cp.cuda.Stream(non_blocking=True)
    f32, s = nccl.NCCL_FLOAT32, stream.ptr
    rows = []
    size = min_bytes
    while size <= max_bytes:
        n = size // 4
        big = cp.random.default_rng(rank).uniform(0.5, 1.5, n, dtype=cp.float32)
        out = cp.empty_like(big)
        part = n // p
        calls = {
            "allreduce": lambda: comm.allReduce(big.data.ptr, out.data.ptr, n, f32, nccl.NCCL_SUM, s),
            "allgather": lambda: comm.allGather(big.data.ptr, out.data.ptr, part, f32, s),
            "reducescatter": lambda: comm.reduceScatter(big.data.ptr, out.data.ptr, part, f32, nccl.NCCL_SUM, s),
        }
        for name, call in calls.items():
            host, gtimes = [], []
            for rep in range(reps + 1):  # rep 0 warms up
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                stream.synchronize()
                if rep:
                    host.append((time.perf_counter() - t0) / iters)
            stream.begin_capture()
            for _ in range(iters):
                call()
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            for _ in range(reps):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                world.Barrier()
                a.record(stream)
                graph.launch(stream)
                b.record(stream)
                b.synchronize()
                gtimes.append(cp.cuda.get_elapsed_time(a, b) * 1e-3 / iters)
            h = world.allreduce(float(np.median(host)), op=MPI.MAX)
            g = world.allreduce(float(np.median(gtimes)), op=MPI.MAX)
            rows.append((name, size, h, g))
        del big, out
        size *= 2
    stream.synchronize()
    world.Barrier()
    comm.destroy()  # on every rank together: left to garbage collection at exit it can hang
    if rank == 0:
        with open(out_csv, "w") as f:
            f.write("collective,bytes,host_s,graph_s\n")
            for r in rows:
                f.write(",".join(map(str, r)) + "\n")


def compare(bare_csv: str, results_dirs: list[str]) -> int:
    import pandas as pd

    bare = pd.read_csv(bare_csv)
    bad = 0
    print(f"{'collective':>14} {'mode':>6} {'bytes':>11} {'bare us':>10} {'harness us':>11} {'ratio':>7}")
    for d in results_dirs:
        st = pd.read_csv(os.path.join(d, "stats.csv"))
        st = st[st["group"].str.startswith("world")]
        for _, r in st.iterrows():
            m = bare[(bare.collective == r.collective) & (bare.bytes == r.bytes)]
            if m.empty:
                continue
            ref = float(m[f"{r['mode']}_s"].iloc[0])
            ratio = r.median_s / ref
            flag = ""
            if r.bytes >= 1 << 20 and abs(ratio - 1) > 0.05:
                bad += 1
                flag = "  <-- off by more than 5%"
            print(f"{r.collective:>14} {r['mode']:>6} {int(r.bytes):>11} {ref * 1e6:>10.2f} "
                  f"{r.median_s * 1e6:>11.2f} {ratio:>7.3f}{flag}")
    print(f"harness vs bare loop at >= 1 MiB: {bad} sizes off by more than 5%")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3:]))
    measure(sys.argv[1])
