"""``python -m kernels compile`` and ``python -m kernels check``."""
from __future__ import annotations

import sys

from calibrate.cli import command_parser, finite_float
from calibrate.errors import UserError
from calibrate.outputs import check_output_path
from calibrate.outputs import write_atomic
from kernels.gc3.algorithms import ALGORITHMS, DEFAULT_MAX_MEMORY_GIB, build, check_size
from kernels.gc3.allocator import reuse_freed_memory
from kernels.gc3.compiler import compile_table
from kernels.gc3.executor import RACE_CHECK_MAX_CLOCK_BYTES, ExecutionError, check_program
from kernels.gc3.verify import DEFAULT_SM_COUNT, verify
from kernels.gc3.xml_io import read_xml, write_xml


def compile_main(argv=None) -> int:
    ap = command_parser("python -m kernels compile", "Compile a GC3 algorithm of the library "
                                 "into MSCCL XML (verified before it is written).")
    ap.add_argument("algorithm", choices=sorted(ALGORITHMS), help="algorithm of the library")
    ap.add_argument("--ranks", type=int, required=True, help="total number of ranks (GPUs)")
    ap.add_argument("--nodes", type=int, default=1, help="nodes, for multi-node algorithms (default 1)")
    ap.add_argument("--channels", type=int, default=1, help="channels (rings) per instance (default 1)")
    ap.add_argument("--instances", type=int, default=1, help="program-wide instances (default 1)")
    ap.add_argument("--protocol", default="Simple", choices=["Simple", "LL", "LL128"],
                    help="NCCL protocol the program's steps use (MSCCL's proto attribute)")
    ap.add_argument("--sm-count", type=int, default=DEFAULT_SM_COUNT, help="SMs of the target GPU")
    ap.add_argument("--max-memory", type=finite_float, default=DEFAULT_MAX_MEMORY_GIB,
                    help="GiB the compiler may use; larger programs are refused before any work "
                         f"(default {DEFAULT_MAX_MEMORY_GIB:g}, and never more than the machine has available)")
    ap.add_argument("-o", "--output", required=True, help="output XML file")
    args = ap.parse_args(argv)
    reuse_freed_memory()
    out = check_output_path(args.output, "output XML")
    if args.sm_count < 1:
        raise UserError(f"--sm-count must be >= 1, got {args.sm_count}")
    check_size(args.algorithm, args.ranks, args.channels, args.instances, args.nodes, args.max_memory)
    if args.channels * args.instances > args.sm_count:
        raise UserError(f"{args.channels} channel(s) x {args.instances} instance(s) need at least "
                        f"{args.channels * args.instances} thread blocks per GPU, more than --sm-count "
                        f"{args.sm_count}; use fewer channels or instances")
    print(f"tracing {args.algorithm} on {args.ranks} ranks", file=sys.stderr)
    prog = build(args.algorithm, args.ranks, args.channels, args.instances, args.protocol, args.nodes)
    print(f"compiling and verifying {len(prog.ops)} ops", file=sys.stderr)
    ir = compile_table(prog, sm_count=args.sm_count)
    del prog
    print(f"writing {ir.steps} steps", file=sys.stderr)
    text = write_xml(ir)
    write_atomic(out, text, "program XML")
    print(f"wrote {out}: {ir.ngpus} GPUs, {ir.max_threadblocks} thread blocks per GPU at most, "
          f"{ir.nchannels} channels, {ir.steps} steps")
    return 0


def check_main(argv=None) -> int:
    ap = command_parser("python -m kernels check", "Load an MSCCL XML, verify it, execute it "
                                 "on the reference executor under random interleavings and print a summary.")
    ap.add_argument("xml", help="MSCCL XML file")
    ap.add_argument("--seeds", type=int, default=8, help="random interleavings and data sets (default 8)")
    ap.add_argument("--sm-count", type=int, default=DEFAULT_SM_COUNT, help="SMs of the target GPU")
    args = ap.parse_args(argv)
    reuse_freed_memory()
    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {args.seeds}")
    if args.sm_count < 1:
        raise UserError(f"--sm-count must be >= 1, got {args.sm_count}")
    ir = read_xml(args.xml)
    print(f"verifying {args.xml}", file=sys.stderr)
    summary = verify(ir, sm_count=args.sm_count)
    print(f"executing under {args.seeds} random interleavings", file=sys.stderr)
    try:
        res = check_program(ir, seeds=args.seeds)
        result = (f"correct {ir.collective} on {args.seeds} seeds, no race, no deadlock" if res.races_checked else
                  f"correct {ir.collective} on {args.seeds} seeds, no deadlock; races not checked "
                  f"(the vector clocks of {res.threadblocks} thread blocks would exceed "
                  f"{RACE_CHECK_MAX_CLOCK_BYTES >> 20} MiB)")
    except ExecutionError as e:
        raise UserError(f"{args.xml}: {e}") from None
    print(f"{ir.name} ({ir.collective}, {ir.protocol.value}, {'in place' if ir.inplace else 'out of place'})")
    print(f"  GPUs           {summary.ngpus}")
    print(f"  thread blocks  {summary.threadblocks} per GPU at most, {summary.total_threadblocks} in all")
    print(f"  channels       {summary.channels} used of {ir.nchannels}")
    print(f"  steps          {summary.steps}")
    print(f"  result         {result}")
    return 0
