"""``python -m autotune``: the SBP strategy search (default), or a subcommand.

    python -m autotune --model gpt            # SBP search on the embedded default profile
    python -m autotune validate ...           # replay plans' collectives, predicted vs measured
    python -m autotune reshard ...            # cross-mesh resharding plans
    python -m autotune schedule ...           # collective schedule tuning (GC3 programs)
"""
from __future__ import annotations

import importlib
import sys

from calibrate.cli import run_cli

SUBCOMMANDS = {
    "validate": "autotune.sbp.validate",
    "reshard": "autotune.reshard.cli",
    "schedule": "autotune.schedule.cli",
}
DEFAULT = "autotune.sbp.cli"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        module, rest, prog = SUBCOMMANDS[argv[0]], argv[1:], f"autotune {argv[0]}"
    else:
        module, rest, prog = DEFAULT, argv, "autotune"
    entry = importlib.import_module(module).main
    return run_cli(entry, rest, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
