"""``python -m kernels <command>``: compile, check and benchmark GC3 programs.

    python -m kernels compile <algorithm> --ranks 8 ... -o x.xml
    python -m kernels check x.xml
    python -m kernels bench            # under mpirun -np 2, on GPUs
"""
from __future__ import annotations

import importlib
import sys

from calibrate.cli import run_cli

SUBCOMMANDS = {
    "compile": "kernels.gc3.cli:compile_main",
    "check": "kernels.gc3.cli:check_main",
    "bench": "kernels.interp.bench:main",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 2 if argv and argv[0] not in ("-h", "--help") else 0
    module, func = SUBCOMMANDS[argv[0]].split(":")
    entry = getattr(importlib.import_module(module), func)
    return run_cli(entry, argv[1:], prog=f"kernels {argv[0]}")


if __name__ == "__main__":
    sys.exit(main())
