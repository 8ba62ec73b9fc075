"""Shared command-line plumbing: user errors become one line on stderr, not a traceback."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from calibrate.collectives import ALL_COLLECTIVES
from calibrate.errors import UserError


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
            prog: str = "") -> int:
    """Call ``main(argv)``; print a ``UserError`` as one line and return 2; Ctrl-C returns 130."""
    try:
        return int(main(argv) or 0)
    except UserError as e:
        print(f"{prog + ': ' if prog else ''}error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog + ': ' if prog else ''}interrupted", file=sys.stderr)
        return 130


def add_timing_args(p: argparse.ArgumentParser, mode_default: str | None, min_default: str | None) -> None:
    """The options of how to time, shared by ``calibrate run`` and ``calibrate validate --random``."""
    p.add_argument("--backend", default="auto", help="nccl (GPUs, cupy), mpi (host buffers) or auto "
                   "(nccl when a GPU is visible, else mpi). Default: auto")
    p.add_argument("--collectives", "-c", default=",".join(c.value for c in ALL_COLLECTIVES),
                   help="comma-separated: allreduce,allgather,reducescatter,alltoall,broadcast,sendrecv")
    p.add_argument("--min-bytes", "-b", default=min_default,
                   help=f"smallest size (K/M/G suffixes). Default {min_default or '1K'}")
    p.add_argument("--max-bytes", "-e", default=None, help="largest size. Default 1G with nccl, 64M with mpi")
    p.add_argument("--dtype", "-d", default="float32", help="float32, float16, bfloat16 (nccl), float64, int32")
    p.add_argument("--iters", "-n", type=int, default=20, help="calls per timed batch (host, graph) or timed calls (isolated)")
    p.add_argument("--warmup", "-w", type=int, default=5, help="untimed calls before timing each size")
    p.add_argument("--reps", type=int, default=5, help="timed batches per size in host and graph modes")
    p.add_argument("--mode", "-m", default=mode_default, help="host (CPU clock, one sync), graph (CUDA graph, "
                   "events) or isolated (barrier, one call, sync). Default " + (mode_default or "the profile's"))
    p.add_argument("--groups", default="world,intra,inter",
                   help="groups to measure: world, intra (ranks of one host), inter (one rank per host)")
    p.add_argument("--out", "-o", default=None, help="results directory. Default results/calib-<date>-<time>")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out, skipping what is done")
