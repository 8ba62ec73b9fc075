"""``python -m kernels bench``: the interpreter and NCCL side by side, under
``mpirun -np N`` (one process per GPU), or with ``--sweep NAME`` the interpreter's
forced-configuration sweep with the machine's ceilings (``kernels.interp.sweep``).

    mpirun -np 2 python -m kernels bench [--collectives allreduce] [--out DIR]   # DIR/bench.json
    mpirun -np 2 python -m kernels bench --sweep model --out DIR                 # DIR/tune.json

Prints an nccl-tests-style table with a speedup column; ``bench.json`` (kind
``kernels-bench``) is for the report, ``tune.json`` (kind ``interp-tune``) for
fitting the interpreter's cost model (``python -m autotune schedule --fit-model``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from calibrate.cli import command_parser
from calibrate.errors import UserError
from calibrate.outputs import check_output_path
from calibrate.sizes import parse_size, sweep

from kernels.interp import bench, pack
from kernels.interp.preset import DEFAULT_PRESET, load_preset
from kernels.interp.records import BenchRecord
from kernels.interp.sweep import sweep_names


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("python -m kernels bench", __doc__.split("\n\n")[0])
    p.add_argument("--collectives", default=",".join(bench.COLLECTIVES),
                   help="comma-separated, from " + ", ".join(bench.COLLECTIVES))
    p.add_argument("--min-bytes", type=parse_size, default=1 << 10, help="smallest size (default 1K)")
    p.add_argument("--max-bytes", type=parse_size, default=1 << 30, help="largest size (default 1G)")
    p.add_argument("--factor", type=int, default=4, help="size step factor (default 4)")
    p.add_argument("--dtype", default="float32", choices=sorted(pack.DTYPES),
                   help="element type of the benchmarked buffers")
    p.add_argument("--preset", default=DEFAULT_PRESET, help="interpreter preset name or JSON path")
    p.add_argument("--reps", type=int, default=7, help="timed graph replays per side (median taken)")
    p.add_argument("--out", default="", help="directory for bench.json or tune.json (default: bench.json not "
                                             "written; the sweep writes to interp_tune_out)")
    p.add_argument("--explain", action="store_true", help="print which program ran for each size and why")
    p.add_argument("--sweep", choices=sweep_names(),
                   help="instead of the table: this forced-configuration sweep and the ceilings, into OUT/tune.json")
    return p


def check_args(args) -> None:
    """Every option checked before a GPU or MPI is touched."""
    names = [c.strip() for c in args.collectives.split(",") if c.strip()]
    for c in names:
        if c not in bench.COLLECTIVES:
            raise UserError(f"unknown collective {c!r}; use some of {', '.join(bench.COLLECTIVES)}")
    if not names:
        raise UserError(f"--collectives is empty; use some of {', '.join(bench.COLLECTIVES)}")
    sweep(args.min_bytes, args.max_bytes, args.factor)
    if args.reps < 1:
        raise UserError(f"--reps must be >= 1, got {args.reps}")
    load_preset(args.preset)
    if args.out:
        check_output_path(args.out, "output directory", directory=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    from calibrate.device.gpu import device_name, mpi_gpu
    from kernels.interp.runtime import Communicator
    from kernels.interp.sweep import main_sweep

    world, cp, local = mpi_gpu("the benchmark")
    if args.sweep:
        return main_sweep(world, Path(args.out or "interp_tune_out"), args.sweep)
    comm = Communicator(world, args.preset)
    rows = bench.run(args, comm)
    if world.rank == 0:
        print(bench.table(rows))
        if args.out:
            path = BenchRecord(device_name(cp, local), world.size, args.preset, rows).save(Path(args.out) / "bench.json")
            print(f"wrote {path}", file=sys.stderr)
    comm.close()
    return 0 if all(r["correct"] for r in rows) else 1
