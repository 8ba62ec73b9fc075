"""``python -m reports <results dirs or JSON files...> -o report.html``: one
self-contained HTML report from any results the project writes (calibration
runs, fitted profiles, plans, benchmarks), a section per kind."""
from __future__ import annotations

import sys
from pathlib import Path

from calibrate.cli import command_parser, run_cli
from calibrate.errors import UserError
from calibrate.jsonfile import read_json
from calibrate.outputs import check_output_path
from calibrate.records import kind_of as record_kind
from reports.html import write_report
from reports.sections import REGISTRY, builder


def kind_of(path: Path) -> str:
    fix = "give a results directory or a JSON file the project wrote"
    if path.is_dir():
        meta = path / "meta.json"
        if not meta.exists():
            raise UserError(f"{str(path)!r} has no meta.json: {fix}")
        data = read_json(meta, "results metadata", fix)
    elif path.is_file():
        data = read_json(path, "input", fix)
    else:
        raise UserError(f"{str(path)!r} does not exist: {fix}")
    kind = record_kind(data)
    if kind not in REGISTRY:
        raise UserError(f"{str(path)!r} is of kind {kind!r}, which no report section knows "
                        f"(known: {', '.join(REGISTRY)})")
    return kind


def main(argv=None) -> int:
    p = command_parser("python -m reports", __doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="results directories and/or JSON files (profiles, plans, ...)")
    p.add_argument("-o", "--out", default="report.html", help="HTML file to write. Default report.html")
    p.add_argument("--title", default="Communication calibration and tuning report",
                   help="the report's title (its first heading and the page title)")
    args = p.parse_args(argv)
    check_output_path(args.out, "report")
    by_kind: dict[str, list[Path]] = {}
    for s in args.inputs:
        path = Path(s)
        by_kind.setdefault(kind_of(path), []).append(path)
    sections = []
    for kind in REGISTRY:  # registry order is the order of the flow
        if kind in by_kind:
            sections.extend(builder(kind)(by_kind[kind]))
    out = write_report(args.out, args.title, sections, sources=[str(s) for s in args.inputs])
    print(f"report written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="reports"))
