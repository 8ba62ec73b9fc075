"""``python -m calibrate <command>``:

    run        time the collectives (under mpiexec/srun), write a results directory
    fit        fit alpha-beta models from results directories into a profile
    validate   print a profile's predictions next to measurements, with the error
    profiles   list the embedded profiles and their provenance
    compute    measure the GPU's matmul, attention and memory throughput into a profile (torch)
"""
from __future__ import annotations

import importlib
import sys

from calibrate.cli import run_cli

SUBCOMMANDS = {
    "run": "calibrate.run",
    "fit": "calibrate.fit_cli",
    "validate": "calibrate.validate",
    "profiles": "calibrate.profiles_cli",
    "compute": "calibrate.compute_run",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    entry = importlib.import_module(SUBCOMMANDS[argv[0]]).main
    if argv[0] == "run":
        return int(entry(argv[1:]) or 0)  # run handles its own errors on every rank
    return run_cli(entry, argv[1:], prog=f"calibrate {argv[0]}")


if __name__ == "__main__":
    sys.exit(main())
