"""``python -m autotune reproduce autoddl``: AutoDDL's evaluation (§4.6, §5) beside ours;
``python -m autotune reproduce published``: published large training runs (Megatron-LM Table 1, Llama 3
405B) with the published configuration forced and the free search side by side (``autotune.published``).

Every case of ``autotune/sbp/presets/autoddl.json`` (the paper's model, batch,
cluster, memory, profile and baselines) is searched under the communication
objective (the paper's) and compared with the paper's figure: the winner and
the communication saved against the best baseline that fits. A case passes when
the winner is the paper's and the reduction is within 10 percentage points.
Writes ``reproduce.json`` (a versioned record) and prints the table. One
configuration for every case (``autotune.reproduce.Config``: the p0 cap on the
transformer cases from the memory the parameters and optimizer states need,
reported under cap 4 and without a cap too; baselines and search over meshes,
micro-batches and VGG Megatron's layer order; every compared plan within the
profile's usable memory at its peak, workspace included) and, per case, the
verdict with alpha or beta halved and doubled (a verdict that flips is marked).
Both compare every case with the previous record (``--previous``): a case that
passed and fails now, or whose searched step (or communication) got worse, is a
regression, and the command exits 1; else 0. A recorded row may re-baseline its case (its "rebaseline": the
figure it replaced and why, where a corrected model no longer prices the step the old figure did): the
comparison is against it, and the command prints which figure and why.

    python -m autotune reproduce autoddl [--case ID ...] [--out DIR] [--previous FILE] [--no-sensitivity]
        [--p0-cap memory|N|0]
"""
from __future__ import annotations

import datetime
from pathlib import Path

from calibrate.cli import command_parser
from calibrate.errors import UserError
from calibrate.jsonfile import write_json
from calibrate.lock import DirLock
from calibrate.outputs import check_output_path

from autotune import published
from autotune.reproduce import (RECORD, TOLERANCE_PP, VERSION, Config, load_cases, passes_by_cap,
                                rebaselined, recorded_rows, records, regressions, run_case, table,
                                worse_figures)


def main(argv=None) -> int:
    ap = command_parser("python -m autotune reproduce", __doc__.split("\n\n")[0], epilog=__doc__)
    ap.add_argument("paper", choices=["autoddl", "published"],
                    help="autoddl: the AutoDDL paper's evaluation; published: published large training runs")
    ap.add_argument("--case", action="append", help="run only this case id (repeatable; default all)")
    ap.add_argument("--out", default="reproduce-out", help="directory for reproduce.json (default ./reproduce-out)")
    ap.add_argument("--previous", default=None,
                    help="the last recorded run (reproduce.json) to compare with; default each case's newest row "
                         "in reports/records/sbp_reproduce_*.json (published: the newest "
                         "published_reproduce_*.json) of this repository")
    ap.add_argument("--no-sensitivity", action="store_true", help="skip the alpha-beta sensitivity runs")
    ap.add_argument("--p0-cap", default=Config.p0_cap,
                    help="most devices a transformer weight is replicated over: 'memory' (default: per case, the "
                         "most at which the parameters and optimizer states fit), a number, or 0 (no cap)")
    args = ap.parse_args(argv)
    if args.paper == "published":
        return _published(args)
    config = Config(p0_cap=_p0_cap(args.p0_cap))
    prev_rows = recorded_rows([Path(args.previous)] if args.previous else records())
    prev = {r["id"]: r["status"] for r in prev_rows}
    cases = load_cases()
    ids = [c["id"] for c in cases]
    for c in args.case or []:
        if c not in ids:
            raise UserError(f"unknown case {c!r}: use one of {', '.join(ids)}")
    out = _out_dir(args)
    with DirLock(out, "reproduction's --out directory"):
        return _reproduce(args, config, prev, prev_rows, cases, out)


def _out_dir(args) -> Path:
    out = Path(args.out)
    check_output_path(out / "reproduce.json", "reproduction record")  # before the cases, not after them
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --out {str(out)!r} ({e.strerror}): give a writable directory") from None
    return out


def _published(args) -> int:
    cases = published.load_cases()
    ids = [c["id"] for c in cases]
    for c in args.case or []:
        if c not in ids:
            raise UserError(f"unknown case {c!r}: use one of {', '.join(ids)}")
    prev_path = Path(args.previous) if args.previous else published.latest_record()
    prev = published.previous_rows(prev_path)
    out = _out_dir(args)
    stamp = datetime.datetime.now().isoformat(timespec="seconds")  # latest_record's order
    with DirLock(out, "reproduction's --out directory"):
        rows = []
        for c in cases:
            if args.case and c["id"] not in args.case:
                continue
            print(f"[reproduce] {c['id']} on {c['profile']} (forced, then the free search)", flush=True)
            rows.append(published.run_case(c))
            print("\n".join("  " + line for line in published.lines(rows[-1])), flush=True)
            # after every case: an interrupted run keeps the cases it finished
            path = write_json(out / "reproduce.json", {"kind": published.RECORD, "version": published.VERSION,
                                                       "recorded": stamp, "rows": rows}, "reproduction record")
        got_worse = published.worse(rows, prev)
        passed = sum(r["status"] == "pass" for r in rows)
        print(f"{passed}/{len(rows)} cases pass (forced within {published.TOLERANCE:.0%} of the published step, "
              f"free search at most {published.SEARCH_SLACK:.0%} slower); "
              + (f"WORSE than the previous record: {'; '.join(got_worse)}" if got_worse
                 else "no step worse than the previous record" if prev else "no previous record to compare with")
              + f"; wrote {path}")
        return 1 if got_worse else 0


def _p0_cap(text: str) -> int | str | None:
    if text == "memory":
        return text
    try:
        cap = int(text)
    except ValueError:
        cap = -1
    if cap < 0:
        raise UserError(f"--p0-cap {text!r}: give 'memory', a number of devices, or 0 for no cap")
    return cap or None


def _reproduce(args, config: Config, prev, prev_rows: list[dict], cases: list[dict], out: Path) -> int:
    rows = []
    for c in cases:
        if args.case and c["id"] not in args.case:
            continue
        print(f"[reproduce] {c['id']} ({c['section']})", flush=True)
        rows.append(run_case(c, config, not args.no_sensitivity))
        t = table(rows[-1:])[0]
        print(f"  paper: {t['paper']}\n  ours:  {t['ours']}\n  difference {t['difference pp']} pp: {t['status']}"
              + (f"\n  {t['sensitivity']}" if t["sensitivity"] != "-" else ""), flush=True)
    config_fields = {"p0_cap": config.p0_cap, "micro_batches": config.micro_batches}
    path = write_json(out / "reproduce.json", {"kind": RECORD, "version": VERSION, "config": config_fields,
                                               "rows": rows}, "reproduction record")
    passed = sum(r["status"] == "pass" for r in rows)
    lost = regressions(rows, prev)
    got_worse = worse_figures(rows, prev_rows)
    others = ", ".join(f"{n} under p0 cap {k}" for k, n in passes_by_cap(rows).items())
    for line in rebaselined(rows, prev_rows):
        print(line)
    print(f"{passed}/{len(rows)} cases pass (same winner, reduction within {TOLERANCE_PP:g} pp; {others}); "
          + (f"REGRESSION: {', '.join(lost)} passed in the previous record and fail now; " if lost else "")
          + (f"WORSE than the previous record: {'; '.join(got_worse)}; " if got_worse else "")
          + ("" if lost or got_worse else "no regression against the previous record (status and searched "
             "figures); " if prev else "no previous record to compare with; ")
          + f"wrote {path}")
    return 1 if lost or got_worse else 0
