"""``python -m autotune``: the SBP strategy search (default), or a subcommand.

    python -m autotune --model gpt            # SBP search on the embedded default profile
    python -m autotune validate ...           # replay plans' collectives, predicted vs measured
    python -m autotune reshard ...            # cross-mesh resharding plans
    python -m autotune schedule ...           # collective schedule tuning (GC3 programs)
    python -m autotune execute plan.json      # run a plan's training steps (torchrun/mpiexec/srun; torch)
"""
from __future__ import annotations

import sys

from calibrate.cli import dispatch

SUBCOMMANDS = {
    "validate": "autotune.sbp.validate:main",
    "reshard": "autotune.reshard.cli:main",
    "schedule": "autotune.schedule.cli:main",
    "execute": "autotune.execute.cli:main",
}
DEFAULT = "autotune.sbp.cli:main"


def main(argv=None) -> int:
    return dispatch("autotune", __doc__, SUBCOMMANDS, argv, default=DEFAULT)


if __name__ == "__main__":
    sys.exit(main())
