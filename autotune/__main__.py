"""``python -m autotune``: the SBP strategy search (default), or a subcommand.

    python -m autotune --model gpt            # SBP search on the embedded default profile
    python -m autotune validate ...           # replay plans' collectives, predicted vs measured
    python -m autotune reshard ...            # cross-mesh resharding plans
    python -m autotune schedule ...           # collective schedule tuning (GC3 programs)
    python -m autotune execute plan.json      # run a plan's training steps (torchrun/mpiexec/srun; torch)
    python -m autotune nccl ...               # stock NCCL tuned through the tuner plugin (under mpirun)
    python -m autotune reproduce autoddl      # AutoDDL's evaluation (§5) beside ours
    python -m autotune explain ...            # the computations behind the reproduction's explanations
"""
from __future__ import annotations

import sys

from calibrate.cli import dispatch

SUBCOMMANDS = {
    "validate": "autotune.sbp.cli.validate:main",
    "reshard": "autotune.reshard.cli:main",
    "schedule": "autotune.schedule.cli:main",
    "execute": "autotune.execute.cli:main",
    "nccl": "autotune.nccl.cli:main",
    "reproduce": "autotune.sbp.cli.reproduce:main",
    "explain": "autotune.sbp.cli.explain:main",
}
DEFAULT = "autotune.__main__:search"


def search(argv=None) -> int:
    """The SBP search, then its HTML report beside plan.json (the report step lives in the command layer)."""
    from autotune.sbp.cli.search import main as search_main

    return search_main(argv, report=write_html)


def write_html(plan_path, title: str):
    from reports.html import write_report
    from reports.sections.sbp import build

    return write_report(plan_path.parent / "report.html", title, build([plan_path]), [str(plan_path)])


def main(argv=None) -> int:
    return dispatch("autotune", __doc__, SUBCOMMANDS, argv, default=DEFAULT)


if __name__ == "__main__":
    sys.exit(main())
