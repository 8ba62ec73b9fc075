"""``python -m reports <results dirs or JSON files...> -o report.html``: one
self-contained HTML report from any results the project writes (calibration
runs, fitted profiles, plans, benchmarks; a folder of calibrate run, of execute
--summarize, or of a search's or tune's --out), a section per kind.

``python -m reports tables FILE.md|RECORD.json ...``: the tuners' tables rendered from
their JSON records (``reports/tables.py``): a record printed, a Markdown file's table
blocks rewritten (``--check``: exit 1 where one is stale, writing nothing)."""
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


EXECUTE_RESULT = "commtune.execute-result"
SUMMARIZE = ("the report reads an execute folder's summary: run python -m autotune execute --summarize DIR, then "
             "give DIR (or DIR/summary.json)")


def kind_of(path: Path) -> str:
    fix = "give a results directory or a JSON file the project wrote"
    if path.is_dir():
        meta = path / "meta.json"
        if not meta.exists():
            raise UserError(f"{str(path)!r} has no meta.json: {SUMMARIZE if any(path.glob('execute-*.json')) else fix}")
        data = read_json(meta, "results metadata", fix)
    elif path.is_file():
        data = read_json(path, "input", fix)
    else:
        raise UserError(f"{str(path)!r} does not exist: {fix}")
    kind = record_kind(data)
    if kind == EXECUTE_RESULT:
        raise UserError(f"{str(path)!r} is one plan's execute result: {SUMMARIZE}")
    if kind not in REGISTRY:
        raise UserError(f"{str(path)!r} is of kind {kind!r}, which no report section knows "
                        f"(known: {', '.join(REGISTRY)})")
    return kind


def tables(argv=None) -> int:
    from reports.tables import render, update

    p = command_parser("python -m reports tables", "Tables of the tuners' records, rendered from the JSON records.")
    p.add_argument("inputs", nargs="+", help="Markdown files (their table blocks rewritten) or JSON records (printed)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 where a block is stale")
    args = p.parse_args(argv)
    stale = []
    for f in args.inputs:
        if f.endswith(".md"):
            stale += [f"{f}: {s}" for s in update(f, check=args.check)]
        else:
            print(render(f))
    for s in stale:
        print(f"{'stale' if args.check else 'rewritten'}: {s}")
    return 1 if args.check and stale else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "tables":
        return run_cli(tables, argv[1:], prog="python -m reports tables")
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
        if path.is_dir() and not (path / "meta.json").exists():  # an execute --out folder summarized, a search's
            path = next((path / f for f in ("summary.json", "plan.json") if (path / f).is_file()), path)  # or tune's
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
