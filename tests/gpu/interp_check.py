"""GPU check of the GC3 interpreter: correctness against NCCL, bad input, benchmark.

    export NCCL_NVLS_ENABLE=0
    mpirun --allow-run-as-root -np 2 python3 tests/gpu/interp_check.py $OUT [--quick] [--ll128]

One process per GPU. For every program that fits the rank count (each algorithm
of the GC3 library compiled for it by the project's compiler, written under
$OUT/programs, and the files of kernels/interp/programs for that count), for each protocol (Simple, LL, LL128), dtype (float32,
bfloat16) and size (the smallest legal count, sizes that do not divide the tile,
up to 1 GiB): fresh random inputs, outputs poisoned, result equal to NCCL's.
Then the bad-input cases, then ``python -m kernels bench``. Writes
$OUT/check.json, $OUT/bench.json; prints a short table last. ``--ll128``: only the
correctness runs, with LL128 on the candidate table h200x2-ll128's transport
($OUT/check-ll128.json; GPU part "peers" runs it).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from calibrate.errors import UserError  # noqa: E402
from kernels.gc3.algorithms import ALGORITHMS  # noqa: E402
from kernels.gc3.compiler import compile_algorithm  # noqa: E402
from kernels.gc3.ir import Protocol  # noqa: E402
from kernels.gc3.xml_io import read_xml, write_xml  # noqa: E402
from kernels.interp import bench, gpudata, pack  # noqa: E402
from kernels.interp.cli import bench as bench_cli  # noqa: E402
from kernels.interp.preset import PROGRAM_DIR, Entry  # noqa: E402
from kernels.interp.records import BenchRecord  # noqa: E402
from kernels.interp.select import Choice  # noqa: E402


def compiled_file(out: Path, name: str, nranks: int) -> Path:
    """Library algorithm ``name`` compiled for ``nranks`` ranks, written as out/programs/NAME_Nr.xml."""
    path = out / "programs" / f"{name}_{nranks}r.xml"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(write_xml(compile_algorithm(name, nranks)))
    return path


def program_files(nranks: int, out: Path, rank: int) -> list[Path]:
    """The library's single-node algorithms compiled for ``nranks`` (rank 0 writes them, the others wait
    at the caller's barrier) and the shipped programs for that count."""
    files = [out / "programs" / f"{n}_{nranks}r.xml" for n in sorted(ALGORITHMS)
             if n not in ("hierarchical_allreduce", "twostep_alltoall", "alltonext")]
    if rank == 0:
        for f in files:
            compiled_file(out, f.name.rsplit("_", 1)[0], nranks)
    return files + [f for f in sorted(PROGRAM_DIR.glob("*.xml")) if read_xml(f).ngpus == nranks]


def counts_for(program, nranks: int, max_bytes: int, esize: int) -> list[int]:
    m = pack.min_count(program, nranks)
    scale = nranks if program.collective in ("allgather", "reducescatter") else 1
    wanted = [m, 3 * m, 1000 * m + m, (1 << 20) // esize + 7 * m, (1 << 24) // esize + 3 * m,
              (1 << 26) // esize, max_bytes // esize // scale]
    out = []
    for c in wanted:
        c = max(m, c // m * m)
        if c * esize * scale <= max_bytes and c not in out:
            out.append(c)
    return out


def log(msg: str, rank: int) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def correctness(comm, cp, files, max_bytes: int, quick: bool,
                protocols=(Protocol.SIMPLE, Protocol.LL, Protocol.LL128)) -> list[dict]:
    from mpi4py import MPI

    rank, nranks = comm.rank, comm.nranks
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for f in files:
        program = comm.load(Entry(str(f)))
        for proto in protocols:
            for dtype in ("float32", "bfloat16"):
                esize = pack.DTYPES[dtype]
                cap = max_bytes if (dtype == "float32" and not quick) else min(max_bytes, 1 << 26)
                for count in counts_for(program, nranks, cap, esize):
                    in_n, out_n = pack.buffer_elems(program.collective, count, nranks)
                    splits = sorted({1, pack.split_for(pack.chunk_elems(program, count, nranks) * esize,
                                                       1 << 17, 16)})
                    for split in splits:
                        t0 = time.perf_counter()
                        choice = comm.choice_for(program, proto, split, count, dtype)
                        big = max(in_n, out_n)
                        send = gpudata.empty(cp, dtype, in_n)
                        ours, ref = gpudata.empty(cp, dtype, out_n), gpudata.empty(cp, dtype, out_n)
                        gpudata.fill_random(cp, send, dtype, seed=7919 * rank + count + split)
                        gpudata.poison(ref, dtype)
                        comm.nccl_collective(program.collective, send.data.ptr, ref.data.ptr, count, dtype, stream)
                        if program.inplace:
                            work = gpudata.empty(cp, dtype, big)
                            gpudata.poison(work, dtype)
                            if program.collective == "allgather":
                                work[rank * count:(rank + 1) * count] = send
                                sbuf, rbuf = work[rank * count:(rank + 1) * count], work
                            else:
                                work[:in_n] = send
                                sbuf = work
                                rbuf = work[rank * count:(rank + 1) * count] if program.collective == \
                                    "reducescatter" else work
                        else:
                            gpudata.poison(ours, dtype)
                            sbuf, rbuf = send, ours
                        cp.cuda.get_current_stream().synchronize()
                        comm.collective(program.collective, sbuf, rbuf, count, dtype, stream=stream, choice=choice)
                        stream.synchronize()
                        ok, err = gpudata.compare(cp, rbuf, ref, dtype, out_n, nranks)
                        ok = bool(comm.mpi.allreduce(int(ok), op=MPI.MIN))
                        row = {"program": program.name, "file": f.name, "protocol": proto.value, "dtype": dtype,
                               "count": count, "bytes": big * esize, "split": split, "ok": ok,
                               "max_rel_err": err, "seconds": time.perf_counter() - t0}
                        rows.append(row)
                        log(f"check {f.name} {proto.value} {dtype} count={count} split={split}: "
                            f"{'ok' if ok else 'WRONG'} (max rel err {err:.2e})", rank)
                        del send, ours, ref
                        cp.get_default_memory_pool().free_all_blocks()
    return rows


def without_ll128(comm, call):
    """``call()`` with the communicator's table stripped of its LL128 FIFO (restored after)."""
    import dataclasses

    saved = comm.preset
    comm.preset = dataclasses.replace(saved, fifo={k: v for k, v in saved.fifo.items() if k != Protocol.LL128})
    try:
        return call()
    finally:
        comm.preset = saved


def bad_input(comm, cp, files, out: Path) -> list[dict]:
    """Each case must raise UserError before anything is launched."""
    rows = []
    if comm.rank == 0:
        compiled_file(out, "ring_allreduce", comm.nranks + 2)
    comm.mpi.Barrier()
    other = out / "programs" / f"ring_allreduce_{comm.nranks + 2}r.xml"
    ar = next(f for f in files if read_xml(f).collective == "allreduce")
    prog = comm.load(Entry(str(ar)))
    x = gpudata.empty(cp, "float32", 1 << 10)
    y = gpudata.empty(cp, "float32", 1 << 10)
    cases = {
        "ir for another rank count": lambda: comm.load(Entry(str(other))),
        "buffer smaller than the call": lambda: comm.collective("allreduce", x, y, 1 << 12, "float32",
                                                                choice=comm.choice_for(prog, Protocol.SIMPLE, 1,
                                                                                       1 << 12, "float32")),
        "unsupported dtype": lambda: comm.choice_for(prog, Protocol.SIMPLE, 1, 1 << 10, "int8"),
        "unsupported reduction": lambda: comm.choice_for(prog, Protocol.SIMPLE, 1, 1 << 10, "float32", op="max"),
        "LL128 on a table without an LL128 FIFO": lambda: without_ll128(
            comm, lambda: comm.choice_for(prog, Protocol.LL128, 1, 1 << 10, "float32")),
        "more thread blocks than the GPU holds": lambda: comm.collective(
            "allreduce", x, y, 1 << 10, "float32",
            choice=Choice(Entry(prog.name), prog, Protocol.SIMPLE, chunk=pack.chunk_elems(prog, 1 << 10, comm.nranks),
                          split=comm.max_resident["float32"] // len(prog.gpus[0].threadblocks) + 1)),
    }
    for name, fn in cases.items():
        try:
            fn()
            rows.append({"case": name, "ok": False, "message": "no error raised"})
        except UserError as e:
            rows.append({"case": name, "ok": True, "message": str(e)})
    cp.cuda.Device().synchronize()
    return rows


def main(argv: list[str]) -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    quick = "--quick" in argv
    ll128 = "--ll128" in argv
    argv = [a for a in argv if a not in ("--quick", "--ll128")]
    out = Path(argv[0] if argv else os.environ.get("OUT", "interp_check_out"))
    from mpi4py import MPI
    import cupy as cp
    from kernels.interp.runtime import Communicator

    from calibrate.device.gpu import select_gpu

    world = MPI.COMM_WORLD
    local = select_gpu(world, needs="the interpreter check", fallback="run it on a GPU machine")
    out.mkdir(parents=True, exist_ok=True)
    files = program_files(world.size, out, world.rank)
    world.Barrier()
    log(f"programs for {world.size} ranks: {[f.name for f in files]}", world.rank)
    max_bytes = 1 << 30
    if ll128:   # LL128 (issue 19): every program, on the candidate table's transport (its LL128 FIFO)
        comm = Communicator(world, "h200x2-ll128")
        checks = correctness(comm, cp, files, max_bytes, quick, protocols=(Protocol.LL128,))
        comm.close()
        if world.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "check-ll128.json").write_text(json.dumps({"checks": checks}, indent=1))
            nbad = sum(not r["ok"] for r in checks)
            print(f"\nLL128 correctness: {len(checks) - nbad}/{len(checks)} runs equal to NCCL "
                  f"({len({r['file'] for r in checks})} programs, float32 and bfloat16)")
            return 0 if nbad == 0 else 1
        return 0
    comm = Communicator(world)
    checks = correctness(comm, cp, files, max_bytes, quick)
    bad = bad_input(comm, cp, files, out)
    comm.close()
    comm = Communicator(world)
    args = bench_cli.build_parser().parse_args(["--max-bytes", "16M" if quick else "1G"])
    rows = bench.run(args, comm)
    comm.close()
    if world.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        device = cp.cuda.runtime.getDeviceProperties(local)["name"].decode()
        (out / "check.json").write_text(json.dumps({"checks": checks, "bad_input": bad}, indent=1))
        (out / "bench.json").write_text(json.dumps(BenchRecord(device, world.size, "h200x2", rows).to_dict(), indent=1))
        nbad = sum(not r["ok"] for r in checks)
        print(f"\ncorrectness: {len(checks) - nbad}/{len(checks)} runs equal to NCCL "
              f"({len({r['file'] for r in checks})} programs, Simple, LL and LL128, float32 and bfloat16)")
        for r in bad:
            print(f"bad input: {r['case']}: {'refused' if r['ok'] else 'NOT REFUSED'}: {r['message']}")
        print(bench.table(rows))
        return 0 if nbad == 0 and all(r["ok"] for r in bad) and all(r["correct"] for r in rows) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
