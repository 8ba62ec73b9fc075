"""``python -m calibrate <command>``:

    run        time the collectives (under mpiexec/srun), write a results directory
    fit        fit alpha-beta models from results directories into a profile
    validate   print a profile's predictions next to measurements, with the error
    profiles   list the embedded profiles and their provenance
    compute    measure the GPU's matmul, attention and memory throughput into a profile (torch)
    health     time every rank and node pair against a profile, name the slow link or node (under MPI)
"""
from __future__ import annotations

import sys

from calibrate.cli import dispatch

SUBCOMMANDS = {
    "run": "calibrate.cli.run:main",  # handles its own errors on every rank
    "fit": "calibrate.cli.fit:main",
    "validate": "calibrate.cli.validate:main",
    "profiles": "calibrate.cli.profiles:main",
    "compute": "calibrate.cli.compute_evaluate:main",
    "module": "calibrate.cli.module:main",
    "health": "calibrate.cli.health:main",  # handles its own errors on every rank
}


def main(argv=None) -> int:
    return dispatch("calibrate", __doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
