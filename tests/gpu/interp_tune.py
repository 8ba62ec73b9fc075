"""Tuning sweep of the GC3 interpreter on 2 GPUs, with the ceilings measured in the same run.

    export NCCL_NVLS_ENABLE=0
    mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE python3 tests/gpu/interp_tune.py $OUT [--sweep first|bands|model]

For every case (preset variant, collective, size, protocol, split, tile cap) the
forced launch is checked against NCCL on fresh random data and timed beside NCCL
(kernels.interp.bench.measure: CUDA graphs, interleaved replays, median, max over
ranks). Ceilings (tests/gpu/interp_ceilings.cu): the graph kernel-node floor, a
minimal one-block LL allreduce, SM push and copy-engine pushes of 1 GiB in both
directions at once. Writes $OUT/tune.json after every row; prints a table last.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels.gc3.interop import msccl_dir  # noqa: E402
from kernels.gc3.ir import Protocol  # noqa: E402
from kernels.gc3.xml_io import read_xml  # noqa: E402
from kernels.interp import bench, gpudata, pack  # noqa: E402
from kernels.interp.preset import Entry, Fifo, load_preset  # noqa: E402
from kernels.interp.select import Choice  # noqa: E402

K, M, G = 1 << 10, 1 << 20, 1 << 30
LL, SIMPLE = Protocol.LL, Protocol.SIMPLE
PROGRAMS = {"allreduce": "direct_allreduce_2r", "reducescatter": "direct_reducescatter_2r",
            "allgather": "direct_allgather_2r"}
# sweep -> variant -> [(collective, sizes, protocol, splits, tile caps)]; "first" chose the
# 2026-11-22 preset's bands, "bands" checked its open questions (reducescatter 1 MiB, tile per band)
FIRST = {
    "base": [
        ("allreduce", [1 * K, 4 * K, 16 * K, 64 * K, 256 * K], LL, [1, 2, 4, 8, 16, 32], [0]),
        ("allreduce", [256 * K, 1 * M], SIMPLE, [16, 32, 64], [16 * K, 64 * K]),
        ("reducescatter", [1 * K, 4 * K, 16 * K, 64 * K, 256 * K, 1 * M], LL, [1, 2, 4, 8, 16, 32], [0]),
        ("reducescatter", [256 * K, 1 * M, 4 * M], SIMPLE, [8, 16, 32, 64], [8 * K, 64 * K]),
        ("allgather", [64 * K, 256 * K, 1 * M], LL, [2, 4, 8, 16, 32], [0]),
        ("allreduce", [64 * M, 1 * G], SIMPLE, [64], [64 * K, 128 * K]),
    ],
    "threads256": [
        ("allreduce", [64 * M, 1 * G], SIMPLE, [64, 128], [64 * K, 128 * K]),
        ("reducescatter", [1 * G], SIMPLE, [128], [64 * K, 128 * K]),
    ],
    "slot256k": [
        ("allreduce", [1 * G], SIMPLE, [64], [128 * K, 256 * K]),
    ],
}
BANDS = {
    "base": [
        ("reducescatter", [1 * M, 2 * M], LL, [32, 64], [0]),
        ("reducescatter", [2 * M], SIMPLE, [64], [64 * K]),
        ("allgather", [2 * M], LL, [32, 64], [0]),
        ("allgather", [2 * M], SIMPLE, [64], [64 * K]),
        ("allreduce", [1 * M, 2 * M], LL, [32, 64], [0]),
        ("allreduce", [16 * M, 32 * M], SIMPLE, [64], [64 * K, 128 * K]),
        ("reducescatter", [16 * M, 64 * M, 1 * G], SIMPLE, [64], [64 * K, 128 * K]),
        ("allgather", [16 * M, 64 * M, 1 * G], SIMPLE, [64], [64 * K, 128 * K]),
    ],
    "threads256": [
        ("reducescatter", [1 * M], LL, [64, 128], [0]),
        ("reducescatter", [1 * M], SIMPLE, [64, 128], [64 * K]),
    ],
}
# "model": what the schedule autotuner's interpreter model is fitted on (variant base only: its
# sizes, protocols, splits and tiles span the schedule search space), then
#   python -m autotune schedule --fit-model $OUT/tune.json
# The last cases run reference MSCCL programs of more than one hop (from kernels.gc3.interop.msccl_dir()),
# on which the model's per-hop cost is fitted.
MODEL = {"base": FIRST["base"] + BANDS["base"] + [
    ("allreduce", [1 * K, 16 * K, 64 * K], SIMPLE, [1, 4, 16], [64 * K]),
    ("allreduce", [4 * M, 16 * M], LL, [16, 32, 64], [0]),
    ("allreduce", [16 * M, 256 * M], SIMPLE, [16, 32], [64 * K, 128 * K]),
    ("allreduce", [256 * K, 1 * M, 4 * M], SIMPLE, [2, 4, 8, 16], [128 * K]),  # few blocks per thread block
    ("allreduce", [1 * M, 4 * M], LL, [4, 8, 16], [0]),
    ("allreduce", [1 * K, 16 * K, 64 * K, 256 * K, 1 * M], LL, [1, 4, 16], [0], "allpairs_allreduce_2r_ll.xml"),
    ("allreduce", [16 * K, 256 * K], LL, [1, 8], [0], "ring_allreduce_2r.xml"),
    ("allreduce", [64 * K, 1 * M, 16 * M], SIMPLE, [4, 16, 32], [64 * K], "ring_allreduce_2r.xml"),
]}
SWEEPS = {"first": FIRST, "bands": BANDS, "model": MODEL}


def variant(name: str):
    base = load_preset("h200x2")
    if name == "threads256":
        return dataclasses.replace(base, name=name, threads=256, max_split=128)
    if name == "slot256k":
        fifo = dict(base.fifo)
        fifo[SIMPLE] = Fifo(base.fifo[SIMPLE].slots, 256 * K)
        return dataclasses.replace(base, name=name, fifo=fifo)
    return base


def log(msg: str, rank: int) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def sweep(world, out: Path, cases_by_variant: dict, record: dict) -> None:
    """Append every case's row to the rows of ``record``'s run, rewriting $OUT/tune.json after each
    one: the record format that `python -m autotune schedule --fit-model` reads."""
    import cupy as cp
    from kernels.interp.runtime import Communicator

    rows = record["runs"][0]["rows"]
    for vname, cases in cases_by_variant.items():
        comm = Communicator(world, variant(vname))
        stream = cp.cuda.Stream(non_blocking=True)
        programs = {p.name: p for _, p in comm.loaded}
        for coll, sizes, proto, splits, tiles, *source in cases:
            program = programs[PROGRAMS[coll]]
            if source:  # a reference MSCCL program instead of the shipped one
                program = read_xml(msccl_dir() / source[0])
                comm.load(Entry(program.name, proto), program)
            for nbytes in sizes:
                count = bench.count_for(coll, nbytes, 4, comm.nranks)
                chunk = pack.chunk_elems(program, count, comm.nranks)
                for split in splits:
                    if chunk * 4 < split * 256:
                        continue
                    for tile in tiles:
                        choice = Choice(Entry(program.name, proto, tile_bytes=tile), program, proto, chunk, split,
                                        reason="forced")
                        row = bench.measure(comm, coll, nbytes, "float32", choice, 7, stream)
                        row.update(variant=vname, tile_bytes=tile, threads=comm.preset.threads)
                        if source:
                            row["program_file"] = source[0]
                        rows.append(row)
                        log(f"{vname:>10} {tile:>7} " + bench._line(row), comm.rank)
                        if comm.rank == 0:
                            (out / "tune.json").write_text(json.dumps(record, indent=1))
        comm.close()


def ceilings(world, out: Path) -> list[dict]:
    """Each ceiling beside NCCL in the same loop: (name, bytes, us per call, GB/s per direction)."""
    import cupy as cp
    from cupy.cuda import nccl
    from mpi4py import MPI

    rank, peer = world.rank, 1 - world.rank
    mod = cp.RawModule(code=(Path(__file__).with_name("interp_ceilings.cu")).read_text(),
                       options=("-std=c++17",))
    empty, oneshot, push = (mod.get_function(n) for n in ("empty_kernel", "oneshot_ll_allreduce_f32", "push_copy"))
    uid = world.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
    nc = nccl.NcclCommunicator(2, uid, rank)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []

    def timed(name, nbytes, graph, n, ref_graph=None):
        graphs = {"x": graph} | ({"nccl": ref_graph} if ref_graph is not None else {})
        t = gpudata.time_graphs(cp, world, stream, graphs, n, 7)
        tx = world.allreduce(statistics.median(t["x"]), op=MPI.MAX)
        tn = world.allreduce(statistics.median(t["nccl"]), op=MPI.MAX) if ref_graph is not None else float("nan")
        row = {"ceiling": name, "bytes": nbytes, "us": tx * 1e6, "nccl_us": tn * 1e6,
               "gbs": nbytes / tx / 1e9 if nbytes else 0.0}
        rows.append(row)
        log(f"ceiling {name:>28} {nbytes:>11} {row['us']:>9.2f} us  nccl {row['nccl_us']:>9.2f} us  "
            f"{row['gbs']:>7.1f} GB/s", rank)
        return row

    with stream:
        g = gpudata.capture(stream, lambda s: empty((1,), (32,), ()), 200)
        timed("graph kernel node (empty)", 0, g, 200)
        # one-shot LL allreduce: 2 buffers of up to 64 KiB of data (128 KiB of lines) each
        buf = cp.zeros(2 * 64 * K // 8 * 16 // 16 * 4, dtype=cp.uint32)  # 2 x 8192 lines x 16 B
        counter = cp.zeros(1, dtype=cp.uint64)
        handles = world.allgather(cp.cuda.runtime.ipcGetMemHandle(buf.data.ptr))
        peer_buf = cp.cuda.runtime.ipcOpenMemHandle(handles[peer], 1)
        world.Barrier()
        for nbytes in (1 * K, 4 * K, 16 * K, 64 * K):
            n = nbytes // 4
            x = cp.random.RandomState(rank + nbytes).standard_normal(n, dtype=cp.float32)
            y, ref = cp.full(n, cp.nan, dtype=cp.float32), cp.full(n, cp.nan, dtype=cp.float32)
            args = (x, y, cp.int64(n), cp.uint64(peer_buf), buf, counter)
            oneshot((1,), (512,), args)
            nc.allReduce(x.data.ptr, ref.data.ptr, n, 7, 0, stream.ptr)
            stream.synchronize()
            ok = world.allreduce(int(bool(cp.allclose(y, ref, rtol=1e-6, atol=0))), op=MPI.MIN)
            g1 = gpudata.capture(stream, lambda s: oneshot((1,), (512,), args), 200)
            g2 = gpudata.capture(stream, lambda s: nc.allReduce(x.data.ptr, ref.data.ptr, n, 7, 0, s.ptr), 200)
            r = timed(f"one-shot LL allreduce ({'ok' if ok else 'WRONG'})", nbytes, g1, 200, g2)
            r["correct"] = bool(ok)
        world.Barrier()
        cp.cuda.runtime.ipcCloseMemHandle(peer_buf)
        # 1 GiB pushed into the peer by both ranks at once: copy engine, SM stores; NCCL allreduce beside
        src, dst = cp.empty(G // 4, dtype=cp.float32), cp.empty(G // 4, dtype=cp.float32)
        src[...] = cp.random.RandomState(rank).standard_normal(G // 4, dtype=cp.float32)
        handles = world.allgather(cp.cuda.runtime.ipcGetMemHandle(dst.data.ptr))
        pdst = cp.cuda.runtime.ipcOpenMemHandle(handles[peer], 1)
        world.Barrier()
        sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
        g_ce = gpudata.capture(stream, lambda s: cp.cuda.runtime.memcpyAsync(pdst, src.data.ptr, G, 3, s.ptr), 5)
        g_nc = gpudata.capture(stream, lambda s: nc.allReduce(src.data.ptr, dst.data.ptr, G // 4, 7, 0, s.ptr), 5)
        timed("copy engine push, both ways", G, g_ce, 5, g_nc)
        for blocks in (sms, 2 * sms):
            g_sm = gpudata.capture(stream, lambda s: push((blocks,), (512,), (src, cp.uint64(pdst), cp.int64(G // 16))), 5)
            timed(f"SM push {blocks} blocks, both ways", G, g_sm, 5, g_nc)
        for nbytes in (512 * K, 1 * M):
            g_sm = gpudata.capture(stream, lambda s: push((2 * sms,), (512,), (src, cp.uint64(pdst),
                                                                              cp.int64(nbytes // 16))), 200)
            g_rs = gpudata.capture(stream, lambda s: nc.reduceScatter(src.data.ptr, dst.data.ptr, nbytes // 4,
                                                                      7, 0, s.ptr), 200)
            timed(f"SM push {2 * sms} blocks, both ways (vs NCCL reducescatter of 2x)", nbytes, g_sm, 200, g_rs)
        world.Barrier()
        cp.cuda.runtime.ipcCloseMemHandle(pdst)
    return rows


def main(argv: list[str]) -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    name = argv[argv.index("--sweep") + 1] if "--sweep" in argv else "first"
    if name not in SWEEPS:
        print(f"unknown sweep {name!r}; use one of {', '.join(SWEEPS)}", file=sys.stderr)
        return 2
    argv = [a for i, a in enumerate(argv) if a != "--sweep" and (i == 0 or argv[i - 1] != "--sweep")]
    out = Path(argv[0] if argv else os.environ.get("OUT", "interp_tune_out"))
    from mpi4py import MPI
    import cupy as cp

    world = MPI.COMM_WORLD
    cp.cuda.Device(world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()).use()
    out.mkdir(parents=True, exist_ok=True)
    ceil = ceilings(world, out)
    if world.rank == 0:
        (out / "ceilings.json").write_text(json.dumps({"rows": ceil}, indent=1))
    rows: list[dict] = []
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    record = {"kind": "interp-tune", "version": 1, "date": time.strftime("%Y-%m-%d"),
              "device": f"{world.size} x {device}", "runs": [{"sweep": name, "rows": rows, "ceilings": ceil}]}
    sweep(world, out, SWEEPS[name], record)
    if world.rank == 0:
        print("\nceilings:")
        for r in ceil:
            print(f"  {r['ceiling']:>32} {r['bytes']:>11} {r['us']:>9.2f} us  nccl {r['nccl_us']:>9.2f} us  "
                  f"{r['gbs']:>7.1f} GB/s")
        best: dict[tuple, dict] = {}
        for r in rows:
            k = (r["collective"], r["bytes"])
            if r["correct"] and (k not in best or r["interp_us"] < best[k]["interp_us"]):
                best[k] = r
        print("\nbest per size (variant tile):")
        for r in best.values():
            print(f"{r['variant']:>10} {r['tile_bytes']:>7} " + bench._line(r))
        print(f"\nrows: {len(rows)}, wrong: {sum(not r['correct'] for r in rows)}")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
