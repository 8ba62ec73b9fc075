"""``python -m autotune nccl``: tune stock NCCL through commtune's tuner plugin.

    python -m kernels build-tuner                                   # once: the plugin (cc)
    mpirun -np 2 python -m autotune nccl --out tuned/               # measure, choose, re-measure
    mpirun -np 2 python -m autotune nccl evaluate tuned/             # confirm: held-out sizes, fresh process
    source tuned/nccl_tuner.env                                     # in a job script: NCCL as tuned
    mpirun -np 2 python -m autotune nccl --table tuned/nccl_tuner.csv --out again/   # re-measure a table

Under mpirun or srun, one process per GPU: measures NCCL per collective and size under
every candidate setting (algorithm x protocol x channels, each on its own communicator
through the plugin; fixed channel counts only from --channels-from up; a setting is dropped
for the larger sizes only where the alpha-beta model says it stays behind: far behind the best
at two size steps in a row where the best is bandwidth-bound and the setting's time grows at
least as fast, never for being behind at small sizes, where Simple loses to LL and yet wins at
large ones), chooses per size band among the settings measured at that size (the default's own
algorithm and protocol unless beaten by --margin; no row, NCCL's choice, where the best measured
is slower than NCCL's default by more than --margin), confirms each band's choice at two sizes
of the band the sweep did not measure (a row stands only where the setting is faster than the
default there by more than --margin and nowhere slower by more than it; elsewhere NCCL decides;
a collective with no confirmed row gets none, and the command says so), writes the table (nccl_tuner.csv)
and the env file (nccl_tuner.env: NCCL_TUNER_PLUGIN, COMMTUNE_NCCL_TUNER_TABLE,
NCCL_MIN_CTAS), then measures NCCL default against NCCL with the plugin and the table on
new communicators in the same run and prints the ratio per collective and size with
#wrong. Everything measured is in nccl_tune.json (kind commtune.nccl-tune), saved after
every setting.

Before the sweep, --heldout sizes per collective (off the sweep's grid) are declared and
hashed into the record: development never measures them. The comparison has five arms
per size, so that each part of the gain is attributed: NCCL's default, the default with
NCCL_MIN_CTAS alone, the table alone, the table with NCCL_MIN_CTAS (the env file), and the
sweep's best fixed setting. ``evaluate`` re-measures those arms in a fresh process at the
held-out sizes (nccl_evaluate.json, kind commtune.nccl-evaluate): the only figures to quote; it
declines there a collective whose gain does not hold (nccl_tuner.evaluated.csv/.env: the rest).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import shlex
import sys
import time
from pathlib import Path

from calibrate.cli import command_parser, finite_float, launcher_rank, message, run_mpi_command
from calibrate.device.dtypes import dtype_size
from calibrate.device.nccl_config import MAX_CHANNELS
from calibrate.errors import UserError
from calibrate.measure import stats
from calibrate.sizes import format_size, parse_size
from calibrate.lock import DirLock
from calibrate.outputs import write_atomic
from kernels.nccl_tuner.build import library
from kernels.nccl_tuner.table import load_table, rows_for, write_table

from autotune.nccl import record as rec
from autotune.nccl.settings import TUNABLE, candidates, parse_channels
from autotune.nccl.bands import parse_sizes

DEFAULT_SIZES = "1K:1G:2"
DEFAULT_COLLECTIVES = "allreduce,allgather,reducescatter"


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("python -m autotune nccl", __doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--collectives", default=DEFAULT_COLLECTIVES,
                   help=f"comma-separated, from {', '.join(TUNABLE)} (default {DEFAULT_COLLECTIVES})")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"min:max:factor or a list (default {DEFAULT_SIZES})")
    p.add_argument("--channels", default="-1,16,32,64",
                   help="channel counts tried with every algorithm and protocol; -1: NCCL's own (default -1,16,32,64)")
    p.add_argument("--min-ctas", type=int, default=MAX_CHANNELS,
                   help=f"channels of the tuned communicators (NCCL_MIN_CTAS in the env file; default {MAX_CHANNELS})")
    p.add_argument("--dtype", default="float32", help="float32, float16, bfloat16, float64, int32 (default float32)")
    p.add_argument("--iters", type=int, default=20, help="calls per CUDA graph (default 20)")
    p.add_argument("--reps", type=int, default=5, help="timed graph replays per point (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each point (default 5)")
    p.add_argument("--prune", type=finite_float, default=1.5,
                   help="drop a setting for the larger sizes once it is this many times slower than the best at two "
                        "size steps in a row where the best is bandwidth-bound and the setting's time grows at least "
                        "as fast (default 1.5)")
    p.add_argument("--channels-from", default="256K",
                   help="smallest size at which fixed channel counts are measured; below it only NCCL's own "
                        "(default 256K)")
    p.add_argument("--margin", type=finite_float, default=0.02,
                   help="a setting replaces the default's own algorithm and protocol (with NCCL's channel count) "
                        "only when faster by more than this fraction (default 0.02)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds of default and tuned in the final comparison (default 5)")
    p.add_argument("--no-check", action="store_true", help="do not check results on random data")
    p.add_argument("--plugin", default=None, help="the plugin library (default: where python -m kernels build-tuner "
                                                  "puts it)")
    p.add_argument("--heldout", type=int, default=4,
                   help="sizes per collective held out for python -m autotune nccl evaluate: declared and hashed "
                        "into the record before the sweep, never measured by it (default 4)")
    p.add_argument("--heldout-seed", type=int, default=26, help="seed of the held-out sizes (default 26)")
    p.add_argument("--table", default=None,
                   help="measure nothing but NCCL default against NCCL with this table (a nccl_tuner.csv)")
    p.add_argument("--out", default=None, help="output directory (default results/nccl-tune-<date>-<time>)")
    return p


def validate(args) -> tuple[list[str], list[int], tuple[int, ...], Path]:
    """Everything that can be refused before a GPU or MPI is touched."""
    colls = [c.strip().lower().replace("_", "") for c in args.collectives.split(",") if c.strip()]
    bad = [c for c in colls if c not in TUNABLE]
    if not colls or bad:
        raise UserError(f"--collectives {args.collectives!r}: choose from {', '.join(TUNABLE)}")
    sizes = parse_sizes(args.sizes)
    dtype_size(args.dtype)
    if not 1 <= args.min_ctas <= MAX_CHANNELS:
        raise UserError(f"--min-ctas {args.min_ctas}: NCCL takes 1..{MAX_CHANNELS}")
    channels = parse_channels(args.channels, args.min_ctas)
    if args.iters < 1 or args.reps < 1 or args.warmup < 0:
        raise UserError("--iters and --reps must be at least 1 and --warmup at least 0")
    if args.prune <= 1:
        raise UserError(f"--prune {args.prune}: must be above 1 (e.g. 1.5)")
    args.channels_from_bytes = parse_size(args.channels_from)
    if not 0 <= args.margin < 0.5 or args.rounds < 1:
        raise UserError("--margin must be in [0, 0.5) and --rounds at least 1")
    if args.heldout < 1:
        raise UserError(f"--heldout {args.heldout}: hold out at least 1 size per collective for evaluate")
    plugin = library(args.plugin)
    if args.table:
        load_table(args.table)
    from autotune.nccl.measure import check_environment

    check_environment(plugin)
    return colls, sizes, channels, plugin


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "evaluate":
        return evaluate_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        colls, sizes, channels, plugin = validate(args)
    except UserError as e:
        if launcher_rank() == 0:
            print(f"autotune nccl: error: {message(e)}", file=sys.stderr)
        return 2
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return run_mpi_command(lambda: run(args, world, colls, sizes, channels, plugin), world, "autotune nccl",
                           "what was measured is in nccl_tune.json")


def _agree(world, fn):
    """``fn()`` on every rank; the first rank's ``UserError`` raised on all of them."""
    problem, value = None, None
    try:
        value = fn()
    except UserError as e:
        problem = message(e)
    problems = [m for m in world.allgather(problem) if m]
    if problems:
        raise UserError(problems[0])
    return value


def run(args, world, colls, sizes, channels, plugin) -> int:
    from calibrate.device.gpu import cupy_or_error, select_gpu
    from calibrate.groups import topology

    t_start = time.perf_counter()
    lead = world.Get_rank() == 0
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if lead else (lambda *a: None)
    ranks = world.Get_size()
    _, nodes, _, _ = topology(world)
    table_rows = _agree(world, lambda: rows_for(load_table(args.table), ranks, nodes, f"tuner table {args.table!r}")
                        if args.table else None)
    _agree(world, lambda: cupy_or_error("autotune nccl (under mpirun, one process per GPU)"))
    device = select_gpu(world, needs="autotune nccl", fallback="run it on GPU nodes")
    out = Path(args.out or os.path.join("results", "nccl-tune-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S")))
    lock = DirLock(out, "nccl tuning output directory")  # one run per --out, a run on another host included
    _agree(world, lambda: (_prepare(out), lock.acquire()) if lead else None)
    try:
        return _tune(args, world, colls, sizes, channels, plugin, t_start, lead, say, ranks, nodes, table_rows, device,
                     out)
    finally:
        lock.release()


def _tune(args, world, colls, sizes, channels, plugin, t_start, lead, say, ranks, nodes, table_rows, device,
          out) -> int:
    """The sweep (or the given table), the ablation, the records (rank 0 writes them)."""
    from calibrate.device.gpu import device_name

    from autotune.nccl.choose import best_fixed, picks, rows_of
    from autotune.nccl.measure import Options, Session, ablation_arms, compare, sweep
    from autotune.nccl.settings import Setting, setting_table

    opts = Options(args.dtype, args.iters, args.warmup, args.reps, not args.no_check, args.prune,
                   args.channels_from_bytes)
    session = _agree(world, lambda: Session(world, device, plugin, args.min_ctas, ranks, nodes, opts))
    import cupy as cp

    record = rec.TuneRecord(
        date=_dt.datetime.now().isoformat(timespec="seconds"), command=" ".join(shlex.quote(a) for a in sys.argv),
        device=f"{ranks} x {device_name(cp, device)}",
        nccl_version=session.nccl_version, ranks=ranks, nodes=nodes, dtype=args.dtype, mode="graph",
        iters=args.iters, reps=args.reps, rounds=args.rounds, min_ctas=args.min_ctas, collectives=colls,
        sizes=sizes, plugin=str(plugin))
    if args.table is None:
        record.heldout = declare_heldout(colls, sizes, ranks, args).to_dict()
    save = (lambda: record.save(out / "nccl_tune.json")) if lead else (lambda: None)
    save()
    say(f"# autotune nccl: {ranks} ranks on {nodes} node(s), {record.device}, NCCL {record.nccl_version}, plugin "
        f"{plugin}; {len(sizes)} sizes {format_size(sizes[0])}..{format_size(sizes[-1])}")
    try:
        if table_rows is None:
            plan = {c: candidates(c, ranks, nodes, channels) for c in colls}
            n_settings = len(dict.fromkeys(s for v in plan.values() for s in v))
            say(f"# sweep: {n_settings} settings (NCCL's default and algorithm x protocol x channels "
                f"{','.join(map(str, channels))}), each on its own communicator of {args.min_ctas} channels")

            def on_sample(s, coll, n, setting, why):
                if s is None:
                    record.pruned.append({"collective": coll, "setting": setting.label, "bytes": n, "why": why})
                else:
                    record.sweep.append(s)

            def on_setting(k, total, setting, seconds, applied):
                record.seconds = {f"sweep_{c}": v for c, v in seconds.items()}
                if not applied:
                    record.not_applied.append(setting.label)
                save()
                said = [s for s in record.sweep if s.setting == setting.label]
                say(f"# [{k}/{total}] {setting.label}: {len(said)} points, "
                    f"{sum(1 for p in record.pruned if p['setting'] == setting.label and p['why'] == 'behind')} "
                    f"dropped (behind), "
                    f"{sum(1 for p in record.pruned if p['setting'] == setting.label and p['why'] == 'channels')} "
                    f"below --channels-from, "
                    f"{sum(max(s.wrong, 0) for s in said)} wrong"
                    f"{'' if applied else ', NOT applied by NCCL (ruled out; never chosen)'}; "
                    f"{time.perf_counter() - t_start:.0f} s so far")

            sweep(session, plan, sizes, on_sample, on_setting)
            chosen = picks(record.sweep, colls, sizes, record.not_applied, args.margin)
            table_rows = rows_of(confirmed(session, record, chosen, colls, sizes, ranks, args, say, save), ranks,
                                 nodes)
        table_path, env_path = out / "nccl_tuner.csv", out / "nccl_tuner.env"
        record.table, record.env_file = str(table_path.resolve()), str(env_path.resolve())
        record.table_rows = [r.line() for r in table_rows]
        header = (f"python -m autotune nccl, {record.date}, {record.device}, NCCL {record.nccl_version}, "
                  f"{ranks} ranks on {nodes} node(s)")
        if lead:
            write_atomic(table_path, write_table(table_rows, [header, "sizes: NCCL's nBytes (the whole buffer); "
                                                             "max_bytes inclusive; channels -1: NCCL's own"]),
                         "tuner table")
            write_atomic(env_path, rec.env_text(plugin, table_path, args.min_ctas, header), "environment file")
            say(f"# wrote {table_path} ({len(table_rows)} rows) and {env_path}")
        save()
        fixed = {}
        for c in colls:
            label = best_fixed(record.sweep, c, record.not_applied) if record.sweep else None
            if label is not None:
                record.fixed[c] = label
                fixed[c] = setting_table(Setting.parse(label), [c], ranks, nodes)
        arms = {c: ablation_arms(table_rows, args.min_ctas, fixed.get(c), record.fixed.get(c, "")) for c in colls}
        print_header(say, lead, args, "development sizes: not to be quoted, see python -m autotune nccl evaluate")

        def on_row(c: rec.Compare):
            record.compare.append(c)
            if lead:
                print(row_line(c), flush=True)

        record.seconds["compare"] = compare(session, arms, sizes, on_row, args.rounds, table=table_rows)
        record.seconds["total"] = time.perf_counter() - t_start
        record.plugin_counters = session.counters()
        save()
    finally:
        session.close()
    return _print_summary(record, say) if lead else 0


def confirmed(session, record: rec.TuneRecord, chosen: list, colls: list[str], sizes: list[int], ranks: int,
              args, say, save) -> list:
    """The picks whose gain holds at the confirmation sizes (``choose.confirm``), measured now: NCCL's
    default and each pick's setting, as the sweep measures them; records what was kept and dropped."""
    from autotune.nccl.choose import confirm, confirmation_sizes, declined
    from autotune.nccl.measure import sweep
    from autotune.nccl.settings import DEFAULT, Setting

    extra = confirmation_sizes(sizes, 128 * ranks, _heldout_sizes(record))
    plan = {c: [DEFAULT] + list(dict.fromkeys(Setting.parse(p.label) for p in chosen if p.collective == c))
            for c in colls}
    say(f"# confirmation: {sum(len(v) - 1 for v in plan.values())} chosen settings and the default at "
        f"{len(extra)} sizes the sweep did not measure")

    def on_sample(s, coll, n, setting, why):
        if s is not None:
            record.confirm.append(s)

    sweep(session, plan, extra, on_sample, lambda *a: save())
    checks = confirm(chosen, record.confirm, args.margin)
    record.confirmations = [c.line() for c in checks]
    record.declined = declined(colls, checks)
    for c in checks:
        say(f"#   {c.line()}")
    for c in record.declined:
        say(f"# {c}: no gain confirmed at sizes it was not tuned on: no rows, NCCL decides at every size")
    keep = [c.pick for c in checks if c.kept and c.pick.collective not in record.declined]
    save()
    return keep


def _heldout_sizes(record: rec.TuneRecord) -> list[int]:
    return sorted({int(n) for v in (record.heldout or {}).get("evaluation", {}).values() for n in v})


def declare_heldout(colls: list[str], sizes: list[int], ranks: int, args):
    """The held-out sizes, declared before any measurement: off the sweep's grid and the confirmation
    sizes, in its range."""
    from calibrate.measure.heldout import declare

    from autotune.nccl.choose import confirmation_sizes

    stamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    development = sorted(set(sizes) | set(confirmation_sizes(sizes, 128 * ranks)))
    return declare("autotune nccl", {c: development for c in colls}, min(sizes), max(sizes), args.heldout,
                   args.heldout_seed, 128 * ranks, stamp)


def print_header(say, lead: bool, args, what: str) -> None:
    say(f"# arms per size: NCCL default, default with NCCL_MIN_CTAS={args.min_ctas} alone, the table alone, the "
        f"table with NCCL_MIN_CTAS (tuned), the sweep's best fixed setting with it; new communicators, CUDA graphs "
        f"of at least {args.iters} calls and 1 ms, {args.rounds} x {args.reps} replays interleaved arm by arm, "
        f"median, maximum over ranks, checked before and after the timed replays; ratio = arm / tuned; {what}")
    if lead:
        print(f"#{'collective':>13} {'size':>10} {'default us':>11} {'tuned us':>10} {'ratio':>6} {'min_ctas':>8} "
              f"{'table':>6} {'fixed':>6}  {'setting':<18} {'#wrong':>6}  NCCL ran (default -> tuned)", flush=True)


def row_line(c: rec.Compare) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    fixed = next((a["name"] for a in c.arms if a["name"].startswith("fixed ")), "")
    wrong = sum(max(a.get("wrong_before", -1), 0) + max(a.get("wrong_after", -1), 0) for a in c.arms)
    missing = [a["name"] + ": " + a["reason"] for a in c.arms if a["status"] != "ok"]
    return (f" {c.collective:>13} {c.bytes:>10} {f(c.default_us, '11.2f')} {f(c.tuned_us, '10.2f')} "
            f"{f(c.ratio, '6.3f')} {f(stats.ratio(c.arm_us('min_ctas'), c.tuned_us), '8.3f')} "
            f"{f(stats.ratio(c.arm_us('table'), c.tuned_us), '6.3f')} "
            f"{f(stats.ratio(c.arm_us(fixed), c.tuned_us), '6.3f')}  {c.setting:<18} {wrong:>6}  "
            f"{c.default_runs or '?'} -> {c.tuned_runs or '?'}" + (f"  MISSING {'; '.join(missing)}" if missing else ""))


def summary_lines(compare: list) -> tuple[list[str], int]:
    """The per-collective summary (targets as verdicts, the gain attributed) and #wrong."""
    lines, wrong = [], 0
    for coll, s in rec.summary(compare).items():
        wrong += s["wrong"]

        def f(x):
            return "-" if x is None else f"{x:.3f}x"
        met = ", ".join(f"{v['target']} {v['state']}" + (f" ({v['why']})" if v["why"] else "") for v in s["verdicts"])
        parts = ", ".join(f"{n} {f(x)}" for n, x in s["against_default"].items())
        lines.append(f"# {coll}: tuned over default geomean {f(s['geomean'])}, worst {f(s['worst'])}"
                     f"{' at ' + format_size(s['worst_bytes']) if s['worst_bytes'] else ''}, "
                     f"{format_size(s['largest_bytes'])} {f(s['largest_ratio'])}, #wrong {s['wrong']}; {met}")
        lines.append(f"#   each arm over the default (geomean): {parts or '-'}; tuned over each: "
                     f"{', '.join(f'{n} {f(x)}' for n, x in s['tuned_over'].items()) or '-'}")
    return lines, wrong


def _prepare(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output directory {str(out)!r} ({e.strerror}): choose --out") from None


def _print_summary(record: rec.TuneRecord, say) -> int:
    lines, wrong = summary_lines(record.compare)
    lines += [f"# {c}: declined: no gain confirmed at sizes it was not tuned on; no rows, NCCL decides"
              for c in record.declined]
    print("\n".join(lines))
    seconds = {k: round(v, 1) for k, v in record.seconds.items()}
    main3 = sum(v for k, v in record.seconds.items() if k in ("sweep_allreduce", "sweep_allgather",
                                                                "sweep_reducescatter"))
    sweep_wrong = sum(max(s.wrong, 0) for s in record.sweep)
    print(f"# sweep: {len(record.sweep)} points, {len(record.pruned)} not measured, #wrong {sweep_wrong}; seconds: "
          f"{seconds}; measuring allreduce+allgather+reducescatter: {main3:.0f} s; plugin counters (rank 0) "
          f"{record.plugin_counters}", flush=True)
    say(f"# record: {Path(record.table).parent / 'nccl_tune.json'}")
    return 1 if wrong or sweep_wrong else 0


# -- python -m autotune nccl evaluate -----------------------------------------------------------
def build_evaluate_parser() -> argparse.ArgumentParser:
    p = command_parser("python -m autotune nccl evaluate",
                       "Confirm a tuned table: its arms re-measured at the development record's held-out sizes.",
                       epilog="""Under mpirun, one process per GPU, in a fresh process (not the development run):
reads nccl_tune.json (its held-out declaration checked against its hash, its table file against
the rows it recorded) and measures, at the held-out sizes only, NCCL's default, the default with
NCCL_MIN_CTAS alone, the table alone, the table with NCCL_MIN_CTAS and the sweep's best fixed
setting, interleaved and checked before and after the timed replays. Writes nccl_evaluate.json
(kind commtune.nccl-evaluate): the figures to quote. A collective whose tuned arm is slower than the
default by more than 2% at a held-out size, or not faster by more than 2% where its rows apply, is
declined: nccl_tuner.evaluated.csv and nccl_tuner.evaluated.env beside the record hold the other
collectives' rows (without NCCL_MIN_CTAS where that alone slows a declined collective).""")
    p.add_argument("record", help="the development run's output directory or its nccl_tune.json")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (x --reps replays) per size")
    p.add_argument("--reps", type=int, default=5, help="replays per round")
    p.add_argument("--iters", type=int, default=20, help="least calls per CUDA graph")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per arm and size")
    p.add_argument("--no-check", action="store_true", help="do not check results (the record says so)")
    p.add_argument("--plugin", default=None, help="the plugin library (default: the record's)")
    p.add_argument("--out", default=None, help="output file (default nccl_evaluate.json beside the record)")
    return p


def evaluate_main(argv) -> int:
    args = build_evaluate_parser().parse_args(argv)
    try:
        dev, declaration, out = _evaluate_inputs(args)
        plugin = library(args.plugin or dev.plugin)
        from autotune.nccl.measure import check_environment

        check_environment(plugin)
    except UserError as e:
        if launcher_rank() == 0:
            print(f"autotune nccl evaluate: error: {message(e)}", file=sys.stderr)
        return 2
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return run_mpi_command(lambda: evaluate(args, world, dev, declaration, out, plugin), world,
                           "autotune nccl evaluate", f"what was measured is in {out}")


def _evaluate_inputs(args):
    from calibrate.measure.heldout import Declaration

    path = Path(args.record)
    path = path / "nccl_tune.json" if path.is_dir() else path
    dev = rec.TuneRecord.load(path)
    if not dev.heldout:
        raise UserError(f"{str(path)!r} declares no held-out sizes (written before evaluate existed): rerun python "
                        f"-m autotune nccl, which declares them before its sweep")
    declaration = Declaration.from_dict(dev.heldout, repr(str(path)))
    if not dev.table_rows and dev.declined and set(dev.declined) >= set(dev.collectives):
        raise UserError(f"{str(path)!r}: the run declined every collective ({', '.join(dev.declined)}: no gain "
                        f"confirmed at sizes it was not tuned on), so its table has no rows and NCCL decides at "
                        f"every size: there is nothing to evaluate")
    if not dev.table_rows or not Path(dev.table).exists():
        raise UserError(f"{str(path)!r}: its table {dev.table!r} is missing: evaluate the directory the run wrote")
    if [r.line() for r in load_table(dev.table)] != dev.table_rows:
        raise UserError(f"{dev.table!r} differs from the rows its record chose: restore it or rerun the tuner")
    if args.rounds < 1 or args.reps < 1 or args.iters < 1 or args.warmup < 0:
        raise UserError("--rounds, --reps and --iters must be at least 1 and --warmup at least 0")
    out = Path(args.out) if args.out else path.parent / "nccl_evaluate.json"
    return dev, declaration, out


def evaluate(args, world, dev: rec.TuneRecord, declaration, out: Path, plugin) -> int:
    from calibrate.device.gpu import cupy_or_error, device_name, select_gpu
    from calibrate.groups import topology
    from calibrate.measure.provenance import command, commit

    from autotune.nccl.measure import Options, Session, ablation_arms, compare
    from autotune.nccl.settings import Setting, setting_table

    t_start = time.perf_counter()
    lead = world.Get_rank() == 0
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if lead else (lambda *a: None)
    ranks = world.Get_size()
    _, nodes, _, _ = topology(world)
    if (ranks, nodes) != (dev.ranks, dev.nodes):
        raise UserError(f"the record is for {dev.ranks} ranks on {dev.nodes} node(s), this job has {ranks} on "
                        f"{nodes}: start mpirun as the development run was")
    rows = _agree(world, lambda: rows_for(load_table(dev.table), ranks, nodes, f"tuner table {dev.table!r}"))
    _agree(world, lambda: cupy_or_error("autotune nccl evaluate (under mpirun, one process per GPU)"))
    device = select_gpu(world, needs="autotune nccl evaluate", fallback="run it on GPU nodes")
    opts = Options(dev.dtype, args.iters, args.warmup, args.reps, not args.no_check)
    session = _agree(world, lambda: Session(world, device, plugin, dev.min_ctas, ranks, nodes, opts))
    import cupy as cp

    record = rec.EvaluateRecord(
        date=_dt.datetime.now().isoformat(timespec="seconds"), command=command(), commit=commit(),
        device=f"{ranks} x {device_name(cp, device)}", nccl_version=session.nccl_version, ranks=ranks, nodes=nodes,
        dtype=dev.dtype, min_ctas=dev.min_ctas, development=str(Path(dev.table).parent / "nccl_tune.json"),
        heldout=declaration.to_dict(), table_rows=dev.table_rows, fixed=dict(dev.fixed), rounds=args.rounds)
    arms = {c: ablation_arms(rows, dev.min_ctas,
                             setting_table(Setting.parse(dev.fixed[c]), [c], ranks, nodes) if c in dev.fixed else None,
                             dev.fixed.get(c, ""))
            for c in dev.collectives}
    print_header(say, lead, _with(args, min_ctas=dev.min_ctas), f"held-out sizes {declaration.evaluation} (declaration sha256 {declaration.sha256[:12]})")

    def on_row(c: rec.Compare):
        record.compare.append(c)
        if lead:
            print(row_line(c), flush=True)
            record.save(out)

    try:
        record.seconds["compare"] = compare(session, arms, declaration.evaluation, on_row, args.rounds, table=rows)
    finally:
        session.close()
    record.seconds["total"] = time.perf_counter() - t_start
    if not lead:
        return 0
    lines, wrong = summary_lines(record.compare)
    lines += _evaluated_table(record, dev, out, plugin)
    record.save(out)
    print("\n".join(lines))
    say(f"# record: {out}")
    return 1 if wrong else 0


def _evaluated_table(record: rec.EvaluateRecord, dev: rec.TuneRecord, out: Path, plugin) -> list[str]:
    """The table that stands after the held-out sizes (``choose.heldout_declines``): the development
    table less the rows of the collectives declined there, written beside ``out`` with its env file
    (none where every collective is declined: NCCL decides). NCCL_MIN_CTAS reaches every collective:
    where it alone slows a declined one (``choose.floor_costs``) the env leaves it out and the rows
    are judged by the table alone. Returns the summary lines that say so."""
    from autotune.nccl.choose import floor_costs, heldout_declines

    rows = load_table(dev.table)
    colls = list(dict.fromkeys(r.collective for r in rows))
    record.declined = heldout_declines(record.compare, collectives=colls)
    floor, lines = record.min_ctas, []
    why = floor_costs(record.compare, record.declined) if record.declined else None
    if why:
        floor = None
        record.declined = heldout_declines(record.compare, collectives=colls, arm="table")
        lines.append(f"# NCCL_MIN_CTAS left out of the evaluated env file ({why}); the rows judged by the table "
                     f"alone")
    lines += [f"# {c}: declined at the held-out sizes: {why}; its rows are left out of the evaluated table, "
              f"NCCL decides at every size" for c, why in record.declined.items()]
    rows = [r for r in rows if r.collective not in record.declined]
    if not rows:
        return lines + ["# evaluated table: no collective confirmed at the held-out sizes: no table, no env "
                        "file; run NCCL as it is"]
    table, env = out.with_name("nccl_tuner.evaluated.csv"), out.with_name("nccl_tuner.evaluated.env")
    header = f"python -m autotune nccl evaluate, {record.date}, {record.device}: {dev.table} less " \
             f"{', '.join(record.declined) or 'nothing'}"
    write_atomic(table, write_table(rows, [header]), "tuner table")
    write_atomic(env, rec.env_text(plugin, table, floor, header), "environment file")
    record.table = str(table.resolve())
    kept = ", ".join(dict.fromkeys(r.collective for r in rows))
    return lines + [f"# evaluated table: {table} ({len(rows)} rows: {kept}); source {env} in a job script"]


def _with(args, **kw):
    return argparse.Namespace(**vars(args), **kw)
