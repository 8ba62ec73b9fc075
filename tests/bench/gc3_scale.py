"""How the GC3 compiler, verifier and reference executor scale with the rank count.

    python tests/bench/gc3_scale.py                      # 32..4096 ranks, ring, all-pairs, hierarchical
    python tests/bench/gc3_scale.py --ranks 32,64 --algorithms ring_allreduce --execute-max 64

Each (algorithm, ranks) runs in its own process (so that its peak memory is its
own) under ``--timeout`` seconds of wall-clock time; sizes whose predicted
memory is over ``--max-memory`` (or what the machine has available) are refused
before any work, as ``kernels compile`` refuses them
(``kernels.gc3.algorithms.check_size``). The
table gives the traced ops, the compiled steps, the seconds (CPU time of the
process; wall time in brackets) of tracing, compiling (to the columnar IR),
static verification and writing the MSCCL XML, the process's peak resident
memory after those, and one execution on the reference executor (on the object
IR) with the peak memory after it. Hierarchical programs use 8 nodes; all-pairs
needs ranks - 1 thread blocks per GPU, more than a GPU's SMs beyond 133 ranks,
so the SM limit is lifted for the benchmark.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from functools import partial

from calibrate.errors import UserError
from kernels.gc3.algorithms import DEFAULT_MAX_MEMORY_GIB

ALGORITHMS = ("ring_allreduce", "allpairs_allreduce", "hierarchical_allreduce")
DEFAULT_RANKS = "32,64,128,256,512,1024,2048,4096"
NODES = {"hierarchical_allreduce": 8}


def _timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(name: str, ranks: int, execute: bool, max_memory_gib: float) -> dict:
    """Trace, compile, verify, write (and execute) one program; the figures as a dict."""
    from kernels.gc3.algorithms import build, check_size
    from kernels.gc3.allocator import reuse_freed_memory
    from kernels.gc3.compiler import compile_table
    from kernels.gc3.executor import check_program
    from kernels.gc3.verify import verify
    from kernels.gc3.xml_io import write_xml

    reuse_freed_memory()      # as kernels compile does
    sm = 10 ** 9
    row = {"algorithm": name, "ranks": ranks}
    try:
        check_size(name, ranks, nodes=NODES.get(name, 1), max_memory_gib=max_memory_gib)
    except UserError as e:
        row["refused"] = str(e)
        return row
    prog, row["trace_s"], row["trace_wall_s"] = _timed(partial(build, name, ranks, nodes=NODES.get(name, 1)))
    row["ops"] = len(prog.ops)
    ir, row["compile_s"], row["compile_wall_s"] = _timed(partial(compile_table, prog, sm, verify_result=False))
    del prog
    row["steps"] = ir.steps
    row["threadblocks_per_gpu"] = ir.max_threadblocks
    _, row["verify_s"], row["verify_wall_s"] = _timed(lambda: verify(ir, sm_count=sm))
    row["peak_mb"] = _peak_mb()
    text, row["write_s"], row["write_wall_s"] = _timed(lambda: write_xml(ir))
    row["xml_mb"] = len(text) / 2 ** 20
    del text
    if execute:
        res, row["execute_s"], row["execute_wall_s"] = _timed(lambda: check_program(ir.to_program(), seeds=1))
        row["races_checked"] = res.races_checked
        row["execute_peak_mb"] = _peak_mb()
    return row


def _cell(row: dict, key: str) -> str:
    if key not in row:
        return "-"
    return f"{row[key]:.1f} ({row[key.replace('_s', '_wall_s')]:.1f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/bench/gc3_scale.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default=DEFAULT_RANKS, help=f"rank counts (default {DEFAULT_RANKS})")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS), help="algorithms (default: %(default)s)")
    ap.add_argument("--execute-max", type=int, default=256,
                    help="execute on the reference executor up to this many ranks (default 256)")
    ap.add_argument("--timeout", type=float, default=900, help="wall-clock seconds per case (default 900)")
    ap.add_argument("--max-memory", type=float, default=DEFAULT_MAX_MEMORY_GIB,
                    help=f"GiB a case may be predicted to use, as kernels compile --max-memory "
                         f"(default {DEFAULT_MAX_MEMORY_GIB:g})")
    ap.add_argument("--worker", nargs=4, metavar=("ALGORITHM", "RANKS", "EXECUTE", "GIB"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.worker[2] == "1", float(args.worker[3]))))
        return 0
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise UserError(f"--ranks {args.ranks!r} is not a comma-separated list of integers; e.g. 32,64") from None
    names = args.algorithms.split(",")
    bad = [n for n in names if n not in ALGORITHMS]
    if bad:
        raise UserError(f"unknown algorithm {bad[0]!r}; choose among {', '.join(ALGORITHMS)}")
    print("| algorithm | ranks | ops | steps | tb/GPU | trace s | compile s | verify s | trace+compile+verify s "
          "| peak MB | write XML s (MB) | execute s (1 seed) | peak MB with execute |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        skip = False
        for r in ranks:
            if skip:
                print(f"| {name} | {r} | skipped: a smaller rank count did not finish | | | | | | | | | | |")
                continue
            cmd = [sys.executable, __file__, "--worker", name, str(r),
                   "1" if r <= args.execute_max else "0", str(args.max_memory)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"| {name} | {r} | over {args.timeout:.0f} s | | | | | | | | | | |", flush=True)
                skip = True
                continue
            if out.returncode != 0:
                why = (out.stderr.strip().splitlines() or ["killed"])[-1][:80]
                print(f"| {name} | {r} | failed (exit {out.returncode}): {why} | | | | | | | | | | |", flush=True)
                skip = True
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            if "refused" in row:
                print(f"| {name} | {r} | refused before any work: {row['refused']} | | | | | | | | | | |",
                      flush=True)
                continue
            total = row["trace_s"] + row["compile_s"] + row["verify_s"]
            exe = _cell(row, "execute_s") + ("" if row.get("races_checked", True) else ", races not checked")
            print(f"| {name} | {r} | {row['ops']} | {row['steps']} | {row['threadblocks_per_gpu']} "
                  f"| {_cell(row, 'trace_s')} | {_cell(row, 'compile_s')} | {_cell(row, 'verify_s')} | {total:.1f} "
                  f"| {row['peak_mb']:.0f} | {_cell(row, 'write_s')} ({row['xml_mb']:.0f}) | {exe} "
                  f"| {format(row['execute_peak_mb'], '.0f') if 'execute_peak_mb' in row else '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    from calibrate.cli import run_cli
    sys.exit(run_cli(main, prog="gc3_scale"))
