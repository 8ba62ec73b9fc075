"""``python -m autotune nccl``: tune stock NCCL through commtune's tuner plugin.

    python -m kernels build-tuner                                   # once: the plugin (cc)
    mpirun -np 2 python -m autotune nccl --out tuned/               # measure, choose, re-measure
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
is slower than NCCL's default by more than --margin), writes the table (nccl_tuner.csv)
and the env file (nccl_tuner.env: NCCL_TUNER_PLUGIN, COMMTUNE_NCCL_TUNER_TABLE,
NCCL_MIN_CTAS), then measures NCCL default against NCCL with the plugin and the table on
new communicators in the same run and prints the ratio per collective and size with
#wrong. Everything measured is in nccl_tune.json (kind commtune.nccl-tune), saved after
every setting.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import shlex
import sys
import time
from pathlib import Path

from calibrate.cli import command_parser, finite_float, message, run_mpi_command
from calibrate.device.dtypes import dtype_size
from calibrate.device.nccl_config import MAX_CHANNELS
from calibrate.errors import UserError
from calibrate.sizes import format_size, parse_size
from calibrate.outputs import write_atomic
from kernels.nccl_tuner.build import library
from kernels.nccl_tuner.table import load_table, rows_for, write_table

from autotune.nccl import record as rec
from autotune.nccl.settings import TUNABLE, candidates, parse_channels
from autotune.schedule.bands import parse_sizes

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
    p.add_argument("--table", default=None,
                   help="measure nothing but NCCL default against NCCL with this table (a nccl_tuner.csv)")
    p.add_argument("--out", default=None, help="output directory (default results/nccl-tune-<date>-<time>)")
    return p


def _lead_rank() -> bool:
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return os.environ[var] == "0"
    return True


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
    plugin = library(args.plugin)
    if args.table:
        load_table(args.table)
    from autotune.nccl.measure import check_environment

    check_environment(plugin)
    return colls, sizes, channels, plugin


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        colls, sizes, channels, plugin = validate(args)
    except UserError as e:
        if _lead_rank():
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
    from calibrate.device.gpu import cupy_or_error, device_name, select_gpu
    from calibrate.groups import topology

    from autotune.nccl.choose import choose
    from autotune.nccl.measure import GRAPH_US, Options, Session, compare, sweep

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
    _agree(world, lambda: _prepare(out) if lead else None)
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
    save = (lambda: record.save(out / "nccl_tune.json")) if lead else (lambda: None)
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
            table_rows = choose(record.sweep, colls, sizes, ranks, nodes, record.not_applied, args.margin)
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
        say("# NCCL default against NCCL tuned (plugin and table), new communicators, CUDA graphs, median of "
            f"{args.rounds} interleaved rounds x {args.reps} replays of a graph of at least {args.iters} calls and "
            f"{GRAPH_US / 1000:g} ms, maximum over ranks; "
            "ratio = default / tuned")
        if lead:
            print(f"#{'collective':>13} {'size':>10} {'default us':>11} {'tuned us':>10} {'ratio':>6}  "
                  f"{'setting':<18} {'#wrong':>6}  NCCL ran (default -> tuned)", flush=True)

        def on_row(c: rec.Compare):
            record.compare.append(c)
            if lead:
                print(f" {c.collective:>13} {c.bytes:>10} {c.default_us:>11.2f} {c.tuned_us:>10.2f} {c.ratio:>6.3f}  "
                      f"{c.setting:<18} {max(c.default_wrong, 0) + max(c.tuned_wrong, 0):>6}  "
                      f"{c.default_runs or '?'} -> {c.tuned_runs or '?'}", flush=True)

        record.seconds["compare"] = compare(session, table_rows, colls, sizes, on_row, args.rounds)
        record.seconds["total"] = time.perf_counter() - t_start
        record.plugin_counters = session.counters()
        save()
    finally:
        session.close()
    return _print_summary(record, say) if lead else 0


def _prepare(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output directory {str(out)!r} ({e.strerror}): choose --out") from None


def _print_summary(record: rec.TuneRecord, say) -> int:
    wrong = 0
    for coll, s in rec.summary(record.compare).items():
        wrong += s["wrong"]
        met = ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in s["targets"].items())
        print(f"# {coll}: geomean {s['geomean']:.3f}x, worst {s['worst']:.3f}x at {format_size(s['worst_bytes'])}, "
              f"{format_size(s['largest_bytes'])} {s['largest_ratio']:.3f}x, #wrong {s['wrong']}; {met}")
    seconds = {k: round(v, 1) for k, v in record.seconds.items()}
    main3 = sum(v for k, v in record.seconds.items() if k in ("sweep_allreduce", "sweep_allgather",
                                                                "sweep_reducescatter"))
    sweep_wrong = sum(max(s.wrong, 0) for s in record.sweep)
    print(f"# sweep: {len(record.sweep)} points, {len(record.pruned)} not measured, #wrong {sweep_wrong}; seconds: "
          f"{seconds}; measuring allreduce+allgather+reducescatter: {main3:.0f} s; plugin counters (rank 0) "
          f"{record.plugin_counters}", flush=True)
    say(f"# record: {Path(record.table).parent / 'nccl_tune.json'}")
    return 1 if wrong or sweep_wrong else 0
