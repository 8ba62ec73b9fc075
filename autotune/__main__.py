"""``python -m autotune``: the SBP strategy search (default), or a subcommand.

    python -m autotune --model gpt            # SBP search on the embedded default profile
    python -m autotune validate ...           # replay plans' collectives, predicted vs measured
    python -m autotune reshard ...            # cross-mesh resharding plans
    python -m autotune schedule ...           # collective schedule tuning (GC3 programs)
    python -m autotune execute plan.json      # run a plan's training steps (torchrun/mpiexec/srun; torch)
    python -m autotune nccl ...               # stock NCCL tuned through the tuner plugin (under mpirun)
    python -m autotune reproduce autoddl      # AutoDDL's evaluation (§5) beside ours
    python -m autotune explain ...            # the computations behind the reproduction's explanations
    python -m autotune export plan.json --to torchtitan|megatron   # the plan as those frameworks' config
    torchrun --nproc-per-node 4 -m autotune tune --model config.json  # search, run the best candidates, keep the fastest
"""
from __future__ import annotations

import sys

from calibrate.cli import dispatch

SUBCOMMANDS = {
    "validate": "autotune.cli.validate:main",
    "reshard": "autotune.reshard.cli:main",
    "schedule": "autotune.schedule.cli:main",
    "execute": "autotune.execute.cli:main",
    "nccl": "autotune.nccl.cli:main",
    "reproduce": "autotune.cli.reproduce:main",
    "explain": "autotune.cli.explain:main",
    "export": "autotune.__main__:export",
    "tune": "autotune.__main__:tune",
}
DEFAULT = "autotune.__main__:search"


def search(argv=None) -> int:
    """The SBP search, then its HTML report beside plan.json (the report step lives in the command layer)."""
    from autotune.cli.search import main as search_main

    return search_main(argv, report=render_html)


def tune(argv=None) -> int:
    """Search, run the best candidates of different kinds, return the measured fastest (``autotune.execute.tune``)."""
    from autotune.execute.tunecli import main as tune_main

    return tune_main(argv, report=write_html)


def write_html(plan_path, title: str):
    """The report page of a plan file already written, beside it (report.html)."""
    from reports.html import write_report
    from reports.sections.sbp import build

    return write_report(plan_path.parent / "report.html", title, build([plan_path]), [str(plan_path)])


def render_html(staged_plan, plan_path, title: str) -> str:
    """The report page of the plan in ``staged_plan``, which the search writes to ``plan_path``."""
    from reports.html import render
    from reports.sections.sbp import build

    return render(title, build([staged_plan], [plan_path]), [str(plan_path)])


def export(argv=None) -> int:
    """A plan as torchtitan's job config or Megatron-LM's flags (``autotune.export``)."""
    from pathlib import Path

    from calibrate.cli import command_parser
    from calibrate.outputs import check_output_path, write_atomic

    from autotune.export import TARGETS
    from autotune.export import export as export_plan
    from autotune.plan.file import PlanFile

    ap = command_parser("python -m autotune export", export_plan.__doc__ + "\n\n    python -m autotune export "
                        "autotune-out/plan.json --to megatron")
    ap.add_argument("plan", help="plan.json written by python -m autotune")
    ap.add_argument("--to", required=True, choices=TARGETS, help="the framework whose config to write")
    ap.add_argument("--which", default="best", help="best, or baseline:NAME (a baseline whose name starts with NAME)")
    ap.add_argument("--out", help="write the config to this file too (default: print only)")
    args = ap.parse_args(argv)
    out = check_output_path(Path(args.out), "export") if args.out else None
    e = export_plan(PlanFile.load(args.plan), args.to, args.which)
    print(e.text, end="")
    if out is not None:
        write_atomic(out, e.text, "export")
        print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return dispatch("autotune", __doc__, SUBCOMMANDS, argv, default=DEFAULT)


if __name__ == "__main__":
    sys.exit(main())
