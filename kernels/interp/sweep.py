"""The interpreter's forced-configuration sweep, with the machine's ceilings measured in
the same run (``python -m kernels bench --sweep NAME``, under ``mpirun -np 2``).

For every case of the sweep (``sweeps.json``: preset variant, collective, sizes,
protocol, splits, tile caps, optionally a multi-hop ``algorithm`` of the GC3 library, compiled
for the communicator's rank count) the forced launch
is checked against NCCL on fresh random data and timed beside it (``bench.measure``).
Ceilings (``ceilings.cu``): the graph kernel-node floor, a minimal one-block LL
allreduce, SM and copy-engine pushes of 1 GiB in both directions at once, each beside
NCCL as arms of the measurement engine (``ceiling_row``; the one-shot allreduce and
its NCCL arm checked on fresh random data before and after the timed replays). The
record (``records.SweepRecord``) is rewritten after every row.

Sweeps: "first" chose the 2026-11-22 preset's bands, "bands" checked its open
questions, "model" is what the interpreter's cost model is fitted on (its sizes,
protocols, splits and tiles span the schedule search space; its last cases run
library programs of more than one hop, on which the per-hop cost is fitted).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

from calibrate.device.gpu import device_name
from calibrate.errors import UserError
from calibrate.measure import engine
from calibrate.records import check_header
from calibrate.sizes import parse_size
from kernels.gc3.compiler import compile_algorithm
from kernels.gc3.ir import Protocol

from kernels.interp import bench, gpudata, pack
from kernels.interp.preset import TUNE_COMMAND, Entry, Fifo, load_preset
from kernels.interp.records import SweepRecord
from kernels.interp.select import Choice

SWEEPS_FILE = Path(__file__).with_name("sweeps.json")
CEILINGS = Path(__file__).with_name("ceilings.cu")
K, M, G = 1 << 10, 1 << 20, 1 << 30


def load_sweeps() -> dict:
    return check_header(json.loads(SWEEPS_FILE.read_text()), "commtune.interp-sweeps", 1, "sweep table",
                        "restore kernels/interp/sweeps.json", str(SWEEPS_FILE))


def sweep_names() -> list[str]:
    return list(load_sweeps()["sweeps"])


def cases(name: str) -> dict[str, list[dict]]:
    """variant -> cases of sweep ``name``."""
    sweeps = load_sweeps()["sweeps"]
    if name not in sweeps:
        raise UserError(f"unknown sweep {name!r}: use one of {', '.join(sweeps)}")
    return sweeps[name]


def variant(name: str, base_preset: str = "h200x2"):
    """The preset with the variant's changes (threads, max_split, the Simple FIFO's slot size)."""
    base = load_preset(base_preset)
    v = load_sweeps()["variants"][name]
    fifo = dict(base.fifo)
    if "simple_slot_bytes" in v:
        fifo[Protocol.SIMPLE] = Fifo(base.fifo[Protocol.SIMPLE].slots, v["simple_slot_bytes"])
    return dataclasses.replace(base, name=name if v else base.name, threads=v.get("threads", base.threads),
                               max_split=v.get("max_split", base.max_split), fifo=fifo)


def log(msg: str, rank: int) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def run_sweep(world, out: Path, name: str, record: SweepRecord) -> list[dict]:
    """Append every case's row to the rows of ``record``'s last run, saving ``out/tune.json`` after each."""
    import cupy as cp
    from kernels.interp.runtime import Communicator

    rows = record.runs[-1]["rows"]
    programs_by_coll = load_sweeps()["programs"]
    for vname, vcases in cases(name).items():
        log(f"variant {vname}: creating the interpreter's communicator", world.rank)
        comm = Communicator(world, variant(vname))
        stream = cp.cuda.Stream(non_blocking=True)
        programs = {p.name: p for _, p in comm.loaded}
        for case in vcases:
            coll, proto, alg = case["collective"], Protocol(case["protocol"]), case.get("algorithm")
            log(f"variant {vname}: case {coll} {proto.value} sizes {' '.join(map(str, case['sizes']))} splits "
                f"{case['splits']} tiles {case['tile_bytes']}" + (f" algorithm {alg}" if alg else ""), comm.rank)
            program = programs[programs_by_coll[coll]]
            if alg:  # a library program compiled for this communicator instead of the shipped one
                program = compile_algorithm(alg, comm.nranks, protocol=proto)
                comm.load(Entry(program.name, proto), program)
            for nbytes in map(parse_size, case["sizes"]):
                count = bench.count_for(coll, nbytes, 4, comm.nranks)
                chunk = pack.chunk_elems(program, count, comm.nranks)
                for split in case["splits"]:
                    if chunk * 4 < split * 256:
                        continue
                    for tile in case["tile_bytes"]:
                        choice = Choice(Entry(program.name, proto, tile_bytes=tile), program, proto, chunk, split,
                                        reason="forced")
                        row = bench.measure(comm, coll, nbytes, "float32", choice, 7, stream)
                        row.update(variant=vname, tile_bytes=tile, threads=comm.preset.threads)
                        if alg:
                            row.update(algorithm=alg, nranks=comm.nranks)
                        rows.append(row)
                        log(f"{vname:>10} {tile:>7} " + bench.line(row), comm.rank)
                        if comm.rank == 0:
                            record.save(out / "tune.json")
        log(f"variant {vname}: closing its communicator", world.rank)
        comm.close()
    return rows


def ceilings(world) -> list[dict]:
    """Each ceiling beside NCCL in the same loop: (name, bytes, us per call, GB/s per direction).

    The CUDA graphs that captured NCCL calls all die inside ``_ceiling_rows``, before the
    communicator is destroyed: ncclCommDestroy (NCCL >= 2.26) waits until every graph holding
    a call on it is destroyed, so one left alive hangs it forever.
    """
    import cupy as cp

    from calibrate.device import nccl as device_nccl

    nc = device_nccl.communicator(world, needs="the sweep")
    stream = cp.cuda.Stream(non_blocking=True)
    rows = _ceiling_rows(world, nc, stream)
    gc.collect()  # graphs caught in reference cycles, if any, die here too
    log("ceilings: destroying their NCCL communicator", world.rank)
    device_nccl.destroy(world, stream, [nc])
    return rows


CEILING_REPS = 7      # interleaved rounds of a ceiling's comparison


def ceiling_row(group, name: str, nbytes: int, arms: list, calls: int, checked: bool,
                reps: int = CEILING_REPS) -> dict:
    """One ceiling: its arms (``x``, the ceiling; ``nccl``, NCCL beside it, when there is one) compared
    by the engine: CUDA graphs of ``calls`` calls, ``reps`` replays interleaved arm by arm, barrier
    before each, median, maximum over ranks; ``checked``: both results checked on fresh random data
    before and after the timed replays, and the name says ok, WRONG or unknown (an arm that did
    not run). An arm that did not run has no time (NaN) and its reason in ``why``."""
    opts = engine.Options(engine.TimingMode.GRAPH, rounds=reps, calls=calls, min_batch_s=0.0, warmup=1,
                          check=checked)
    res = engine.compare(group, arms, opts)
    names = [n for n, _ in arms]
    missing = res.missing(names)
    x, ref = res["x"], res.arms.get("nccl")

    def us(a) -> float:
        return a.median_s * 1e6 if a is not None and a.median_s is not None else float("nan")

    row = {"ceiling": name, "bytes": nbytes, "us": us(x), "nccl_us": us(ref),
           "gbs": nbytes / x.median_s / 1e9 if nbytes and x.median_s else 0.0,
           "status": x.status.value, "nccl_status": ref.status.value if ref is not None else "",
           "why": "; ".join(missing), "checked": "before timing and after the timed replays" if checked else "no"}
    if checked:
        wrong = any(res[n].status is engine.Status.WRONG for n in names)
        state = "WRONG" if wrong else ("unknown" if missing else "ok")
        row["ceiling"], row["correct"] = f"{name} ({state})", state == "ok"
        row["wrong_before"], row["wrong_after"] = x.wrong_before, x.wrong_after
    return row


def _ceiling_rows(world, nc, stream) -> list[dict]:
    """The ceilings' rows, measured with NCCL communicator ``nc`` on ``stream``; every graph is local."""
    import cupy as cp

    rank, peer = world.rank, 1 - world.rank
    group = engine.MpiGroup(world)
    mod = cp.RawModule(code=CEILINGS.read_text(), options=("-std=c++17",))
    empty, oneshot, push = (mod.get_function(n) for n in ("empty_kernel", "oneshot_ll_allreduce_f32", "push_copy"))
    rows = []

    def arm(launch):
        return lambda: gpudata.StreamArm(cp, stream, launch)

    def timed(name, nbytes, arms, calls, checked=False):
        row = ceiling_row(group, name, nbytes, arms, calls, checked)
        rows.append(row)
        log(f"ceiling {row['ceiling']:>28} {nbytes:>11} {row['us']:>9.2f} us  nccl {row['nccl_us']:>9.2f} us  "
            f"{row['gbs']:>7.1f} GB/s" + (f"  ({row['why']})" if row["why"] else ""), rank)
        return row

    with stream:
        timed("graph kernel node (empty)", 0, [("x", arm(lambda s: empty((1,), (32,), ())))], 200)
        # one-shot LL allreduce: 2 buffers of up to 64 KiB of data (128 KiB of lines) each
        buf = cp.zeros(2 * 64 * K // 8 * 16 // 16 * 4, dtype=cp.uint32)  # 2 x 8192 lines x 16 B
        counter = cp.zeros(1, dtype=cp.uint64)
        handles = world.allgather(cp.cuda.runtime.ipcGetMemHandle(buf.data.ptr))
        peer_buf = cp.cuda.runtime.ipcOpenMemHandle(handles[peer], 1)
        world.Barrier()
        for nbytes in (1 * K, 4 * K, 16 * K, 64 * K):
            n = nbytes // 4
            x = gpudata.empty(cp, "float32", n)      # float32 bits; the kernel reads them through a pointer
            y, ref = gpudata.empty(cp, "float32", n), gpudata.empty(cp, "float32", n)
            gpudata.fill_random(cp, x, "float32", seed=rank + nbytes)
            args = (x, y, cp.int64(n), cp.uint64(peer_buf), buf, counter)

            def checked_arm(launch, out, x=x, n=n):
                return lambda: gpudata.LaunchArm(cp, stream, launch, x, out.data.ptr, n, "allreduce", n, "float32",
                                                 rank, world.size, out)
            timed("one-shot LL allreduce", nbytes,
                  [("x", checked_arm(lambda s, args=args: oneshot((1,), (512,), args), y)),
                   ("nccl", checked_arm(lambda s, x=x, ref=ref, n=n: nc.allReduce(x.data.ptr, ref.data.ptr, n, 7, 0,
                                                                                 s.ptr), ref))],
                  200, checked=True)
        world.Barrier()
        cp.cuda.runtime.ipcCloseMemHandle(peer_buf)
        # 1 GiB pushed into the peer by both ranks at once: copy engine, SM stores; NCCL allreduce beside
        src, dst = cp.empty(G // 4, dtype=cp.float32), cp.empty(G // 4, dtype=cp.float32)
        src[...] = cp.random.RandomState(rank).standard_normal(G // 4, dtype=cp.float32)
        handles = world.allgather(cp.cuda.runtime.ipcGetMemHandle(dst.data.ptr))
        pdst = cp.cuda.runtime.ipcOpenMemHandle(handles[peer], 1)
        world.Barrier()
        sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
        nccl_1g = ("nccl", arm(lambda s: nc.allReduce(src.data.ptr, dst.data.ptr, G // 4, 7, 0, s.ptr)))
        timed("copy engine push, both ways", G,
              [("x", arm(lambda s: cp.cuda.runtime.memcpyAsync(pdst, src.data.ptr, G, 3, s.ptr))), nccl_1g], 5)
        for blocks in (sms, 2 * sms):
            timed(f"SM push {blocks} blocks, both ways", G,
                  [("x", arm(lambda s, blocks=blocks: push((blocks,), (512,), (src, cp.uint64(pdst),
                                                                              cp.int64(G // 16))))), nccl_1g], 5)
        for nbytes in (512 * K, 1 * M):
            timed(f"SM push {2 * sms} blocks, both ways (vs NCCL reducescatter of 2x)", nbytes,
                  [("x", arm(lambda s, nbytes=nbytes: push((2 * sms,), (512,), (src, cp.uint64(pdst),
                                                                                 cp.int64(nbytes // 16))))),
                   ("nccl", arm(lambda s, nbytes=nbytes: nc.reduceScatter(src.data.ptr, dst.data.ptr, nbytes // 4,
                                                                           7, 0, s.ptr)))], 200)
        world.Barrier()
        cp.cuda.runtime.ipcCloseMemHandle(pdst)
    stream.synchronize()
    return rows


def main_sweep(world, out: Path, name: str) -> int:
    """The ceilings, then the sweep; prints the ceilings and the best row per size; 1 if any row is wrong."""
    import cupy as cp

    cases(name)  # unknown names fail before any work
    if world.size != 2:
        raise UserError(f"the sweep's ceilings and shipped programs pair two GPUs, this run has {world.size}: run it "
                        f"under mpirun -np 2; for {world.size} ranks the table comes from "
                        f"{TUNE_COMMAND.format(n=world.size)}")
    out.mkdir(parents=True, exist_ok=True)
    ceil = ceilings(world)
    record = SweepRecord(f"{world.size} x {device_name(cp, cp.cuda.Device().id)}",
                         [{"sweep": name, "rows": [], "ceilings": ceil}])
    rows = run_sweep(world, out, name, record)
    if world.rank == 0:
        record.save(out / "tune.json")
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
            print(f"{r['variant']:>10} {r['tile_bytes']:>7} " + bench.line(r))
        print(f"\nrows: {len(rows)}, wrong: {sum(not r['correct'] for r in rows)}")
    return 0 if all(r["correct"] for r in rows) else 1
