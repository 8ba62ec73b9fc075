"""``python -m autotune reproduce autoddl``: AutoDDL's evaluation (§4.6, §5) beside ours.

Every case of ``autotune/sbp/presets/autoddl.json`` (the paper's model, batch,
cluster, memory, profile and baselines) is searched under the communication
objective (the paper's) and compared with the paper's figure: the winner and
the communication saved against the best baseline that fits. A case passes when
the winner is the paper's and the reduction is within 10 percentage points.
Writes ``reproduce.json`` (a versioned record) and prints the table.

    python -m autotune reproduce autoddl [--case ID ...] [--out DIR]
"""
from __future__ import annotations

from pathlib import Path

from calibrate.cli import command_parser
from calibrate.errors import UserError
from calibrate.jsonfile import write_json
from calibrate.lock import DirLock
from calibrate.outputs import check_output_path

from autotune.sbp.reproduce import RECORD, TOLERANCE_PP, VERSION, load_cases, run_case, table


def main(argv=None) -> int:
    ap = command_parser("python -m autotune reproduce", __doc__.split("\n\n")[0], epilog=__doc__)
    ap.add_argument("paper", choices=["autoddl"], help="the paper whose evaluation to reproduce")
    ap.add_argument("--case", action="append", help="run only this case id (repeatable; default all)")
    ap.add_argument("--out", default="reproduce-out", help="directory for reproduce.json (default ./reproduce-out)")
    args = ap.parse_args(argv)
    cases = load_cases()
    ids = [c["id"] for c in cases]
    for c in args.case or []:
        if c not in ids:
            raise UserError(f"unknown case {c!r}: use one of {', '.join(ids)}")
    out = Path(args.out)
    check_output_path(out / "reproduce.json", "reproduction record")  # before the cases, not after them
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --out {str(out)!r} ({e.strerror}): give a writable directory") from None
    with DirLock(out, "reproduction's --out directory"):
        return _reproduce(args, cases, out)


def _reproduce(args, cases: list[dict], out: Path) -> int:
    rows = []
    for c in cases:
        if args.case and c["id"] not in args.case:
            continue
        print(f"[reproduce] {c['id']} ({c['section']})", flush=True)
        rows.append(run_case(c))
        t = table(rows[-1:])[0]
        print(f"  paper: {t['paper']}\n  ours:  {t['ours']}\n  difference {t['difference pp']} pp: {t['status']}",
              flush=True)
    path = write_json(out / "reproduce.json", {"kind": RECORD, "version": VERSION, "rows": rows}, "reproduction record")
    passed = sum(r["status"] == "pass" for r in rows)
    print(f"{passed}/{len(rows)} cases pass (same winner, reduction within {TOLERANCE_PP:g} pp); wrote {path}")
    return 0
