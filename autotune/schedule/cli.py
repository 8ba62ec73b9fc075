"""``python -m autotune schedule``: tune GC3 schedules per size band.

    python -m autotune schedule --collective allreduce --gpus 2 --out tuned/
    mpirun -np 2 python -m autotune schedule --collective allreduce --gpus 2 --out tuned/   # measures on GPUs
    python -m autotune schedule --rescore tuned/schedule.json        # the model against a recorded run
    mpirun -np 2 python -m autotune schedule evaluate tuned/          # confirm: held-out sizes, fresh process

For each size band: enumerate the candidates of the search space (algorithm of
the GC3 library x channels x instances x protocol x CUDA blocks per thread block),
rank them with the interpreter cost model (kernels/interp/model.py: the
profile's link, fitted per-protocol and per-CUDA-block costs), and, when run under
mpirun with one process per GPU, measure the best few (--candidates) and the
fixed-configuration contenders with the interpreter beside NCCL; choose per band.
Without GPUs it runs on the model alone and says that nothing was measured.

Writes to --out: programs/*.xml (MSCCL XML, minBytes/maxBytes set), manifest.json
(an interpreter preset: python -m kernels bench --preset OUT/manifest.json),
nccl_tuner.conf (NCCL's example tuner plugin CSV), schedule.json (kind
schedule-tune, for python -m reports) and model_correction.json when measured.

Its figures are development figures: the best of the measured candidates per band
against NCCL measured beside them, at the sizes chosen on. Before measuring, --heldout
sizes per collective (between the bands' sizes) are declared and hashed into
schedule.json; ``evaluate`` re-measures at those only, in a fresh process, the tuned
manifest, NCCL, NCCL's best setting (--nccl-run: an NCCL tuning run's table), the best
fixed configuration and the tuned choice with each knob as fixed, as medians
(schedule_evaluate.json, kind commtune.schedule-evaluate): the figures to quote.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import time
from pathlib import Path

from calibrate import profile as profiles
from calibrate.cli import command_parser, launcher_rank, run_mpi_command, run_on_ranks
from calibrate.collectives import Collective
from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.lock import DirLock
from calibrate.outputs import check_output_path, replace_dir, staged_dir, write_atomic
from kernels.gc3.algorithms import check_size
from kernels.interp import pack
from kernels.interp.model import DEFAULT_PARAMS, load_params
from kernels.interp.preset import DEFAULT_PRESET, load_preset

from autotune.schedule import outputs
from autotune.nccl.bands import DEFAULT_SIZES, bands_for, parse_sizes
from autotune.schedule.choose import finish
from autotune.schedule.measure import device_name, gpu_world, measure
from autotune.schedule.model import Correction, Model
from autotune.schedule.plan import log, rank_bands, select
from autotune.schedule.rescore import fit_report, fmt, rescore
from autotune.schedule.result import NCCL, CollectiveResult, TuneResult
from autotune.schedule.space import DEFAULT_SPACE, enumerate_candidates, load_space

TUNABLE = ("allreduce", "allgather", "reducescatter", "alltoall")


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("python -m autotune schedule", __doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--collective", default="allreduce", help=f"comma-separated, from {', '.join(TUNABLE)}")
    p.add_argument("--gpus", type=int, default=2, help="total GPUs (ranks) of the communicator (default 2)")
    p.add_argument("--nodes", type=int, default=1, help="nodes they span (default 1)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default gpus / nodes)")
    p.add_argument("--profile", default=profiles.DEFAULT_PROFILE,
                   help=f"fitted profile name or JSON file (default {profiles.DEFAULT_PROFILE})")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"band sizes, min:max:factor or a list (default {DEFAULT_SIZES})")
    p.add_argument("--candidates", type=int, default=4,
                   help="candidates measured per band, best by the model first (default 4), with at least "
                        "the best candidates/2 of each protocol; the fixed-configuration contenders are measured in "
                        "every band on top")
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)  # renamed: --candidates
    p.add_argument("--space", default=DEFAULT_SPACE, help="search space name or JSON file (default spaces)")
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"interpreter preset whose transport is used (default {DEFAULT_PRESET})")
    p.add_argument("--correction", help="model_correction.json of an earlier measured run, to rank with")
    p.add_argument("--model-params", default=DEFAULT_PARAMS,
                   help=f"interpreter model parameters, name or JSON file (default {DEFAULT_PARAMS})")
    p.add_argument("--rescore", metavar="SCHEDULE_JSON",
                   help="measure nothing: predict the measured rows of a recorded run again with the current "
                        "model and print them beside the measurements, with Spearman per band")
    p.add_argument("--fit-model", metavar="INTERP_TUNE_JSON",
                   help="measure nothing: fit the interpreter model's parameters on an interpreter sweep record "
                        "and print them (the JSON of kernels/interp/fitted/interp_model.json)")
    p.add_argument("--dtype", default="float32", choices=sorted(pack.DTYPES),
                   help="element type of the collectives' buffers")
    p.add_argument("--reps", type=int, default=5, help="timed graph replays per candidate (default 5)")
    p.add_argument("--model-only", action="store_true", help="do not measure even where GPUs are available")
    p.add_argument("--heldout", type=int, default=4,
                   help="sizes per collective held out for python -m autotune schedule evaluate, declared before "
                        "measuring (default 4)")
    p.add_argument("--heldout-seed", type=int, default=26, help="seed of the held-out sizes (default 26)")
    p.add_argument("--out", default="schedule-out", help="output directory (default schedule-out)")
    return p


def _check(args) -> tuple[list[str], int]:
    colls = []
    for c in args.collective.split(","):
        if c.strip():
            name = Collective.parse(c).value
            if name not in TUNABLE:
                raise UserError(f"--collective {name} cannot be tuned; use some of {', '.join(TUNABLE)}")
            colls.append(name)
    if not colls:
        raise UserError("--collective is empty; give e.g. --collective allreduce")
    if args.gpus < 2:
        raise UserError(f"--gpus {args.gpus}: a collective needs at least 2 GPUs")
    if args.nodes < 1 or args.gpus % args.nodes:
        raise UserError(f"--gpus {args.gpus} is not a multiple of --nodes {args.nodes}; fix one of them")
    gpn = args.gpus_per_node or args.gpus // args.nodes
    if gpn * args.nodes != args.gpus:
        raise UserError(f"--gpus-per-node {gpn} x --nodes {args.nodes} != --gpus {args.gpus}; make them agree")
    check_size("ring_allreduce", args.gpus, nodes=args.nodes)  # every candidate is a GC3 program this big
    if args.budget is not None:
        raise UserError(f"--budget of autotune schedule is now --candidates (candidates measured per band; "
                        f"--budget means time in the other commands): use --candidates {args.budget}")
    if args.candidates < 1:
        raise UserError(f"--candidates {args.candidates}: measure at least 1 candidate per band")
    if args.reps < 1:
        raise UserError(f"--reps {args.reps}: time at least 1 replay")
    if args.heldout < 1:
        raise UserError(f"--heldout {args.heldout}: hold out at least 1 size per collective for evaluate")
    return colls, gpn


def _load_correction(path: str | None) -> Correction | None:
    if not path:
        return None
    return Correction.from_dict(read_json(path, "model correction", "give a model_correction.json"), repr(path))


def report_table(res: CollectiveResult, measured: bool) -> str:
    lines = [f"{res.collective}: chosen per band ({res.summary.get('basis')})",
             f"{'band':>18} {'size':>11} {'choice':>44} {'pred us':>9} {'meas us':>9} {'nccl us':>9} "
             f"{'vs nccl':>7} {'rho':>5}"]
    for b in res.bands:
        r = b.row(b.choice)
        pred = b.nccl_predicted_us if b.choice == NCCL else r.predicted_us
        meas = b.nccl_measured_us if b.choice == NCCL else (r.measured_us if r else None)
        nccl = b.nccl_measured_us if measured else b.nccl_predicted_us
        mine = meas if measured else pred
        lines.append(f"{b.lo:>8}-{b.hi if b.hi else 'inf':>9} {b.rep:>11} {b.choice:>44} {fmt(pred, '.1f'):>9} "
                     f"{fmt(meas, '.1f'):>9} {fmt(nccl, '.1f'):>9} {fmt(nccl / mine if nccl and mine else None, '.2f'):>7} "
                     f"{fmt(b.spearman, '.2f'):>5}")
    s = res.summary
    lines.append(f"fixed baseline {res.fixed_baseline or '-'}: tuned table {fmt(s.get('speedup_over_fixed_geomean'), '.2f')}x "
                 f"geomean; over NCCL {fmt(s.get('speedup_over_nccl_geomean'), '.2f')}x geomean, "
                 f"{fmt(s.get('speedup_over_nccl_min'), '.2f')}x worst band")
    if measured:
        lines.append(f"Spearman per band: min {fmt(s.get('spearman_min'), '.2f')} (model as ranked), "
                     f"min {fmt(s.get('spearman_corrected_min'), '.2f')} (per-protocol correction, "
                     f"leave-one-band-out); bands below 0.8: {s.get('bands_below_0.8')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "evaluate":
        return evaluate_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.rescore or args.fit_model:
        prof, base_preset = profiles.Profile.load(args.profile), load_preset(args.preset)
        if args.fit_model:
            print(fit_report(args.fit_model, prof, base_preset))
        else:
            print(rescore(args.rescore, prof, base_preset, load_params(args.model_params)))
        return 0
    colls, gpn = _check(args)
    check_output_path(args.out, "output directory", directory=True)
    t_start = time.perf_counter()
    prof = profiles.Profile.load(args.profile)
    space = load_space(args.space)
    base_preset = load_preset(args.preset)
    params = load_params(args.model_params)
    correction = _load_correction(args.correction)
    bands_spec = bands_for(parse_sizes(args.sizes))

    world, cp, reason = (None, None, "--model-only was given") if args.model_only else gpu_world(args.gpus)
    if world is None and launcher_rank() != 0:
        return 0  # nothing to measure under a launcher: rank 0 chooses and writes alone
    lock = DirLock(args.out, "schedule output directory")  # two runs into one --out: the second refused
    if world is None:
        lock.acquire()
    elif run_on_ranks(world, lambda: lock.acquire() if world.rank == 0 else True, "autotune schedule",
                      collective=True) is None:
        return 2
    try:
        return _tune(args, colls, gpn, t_start, prof, space, base_preset, params, correction, bands_spec,
                     world, cp, reason)
    finally:
        lock.release()


def _tune(args, colls, gpn, t_start, prof, space, base_preset, params, correction, bands_spec, world, cp,
          reason) -> int:
    """Choose (and measure) every collective's table, and write the outputs (on rank 0)."""
    measuring = world is not None
    # before anything is measured (a model-only run has nothing to evaluate)
    declaration = declare_heldout(colls, bands_spec, args) if measuring else None
    lead = world is None or world.rank == 0
    say = log if lead else None
    if not measuring and say:
        say(f"nothing will be measured: {reason}; choosing from the model alone")

    results, built_by_coll = [], {}
    t_model = t_measure = 0.0
    comm = None
    for coll in colls:
        t0 = time.perf_counter()
        built, notes = enumerate_candidates(space, coll, args.gpus, args.nodes)
        if say:
            say(f"{coll}: {len(built)} candidates on {args.gpus} GPUs ({args.nodes} node(s)), "
                f"{len(bands_spec)} bands, profile {prof.name}")
        model = Model(prof, coll, args.gpus, args.nodes, gpn, pack.DTYPES[args.dtype], base_preset.fifo, params,
                      correction)
        bands = rank_bands(model, built, bands_spec, say)
        by_key = {b.candidate.key: b for b in built}
        select(bands, args.candidates, {k: b.candidate.protocol for k, b in by_key.items()})
        res = CollectiveResult(coll, {k: b.candidate for k, b in by_key.items()}, bands, notes=notes)
        t_model += time.perf_counter() - t0
        if measuring:
            from kernels.interp.runtime import Communicator

            chosen = world.bcast([[r.key for r in b.rows if r.selected] for b in bands], root=0)
            for b, keys in zip(bands, chosen):
                for r in b.rows:
                    r.selected = r.key in keys
            t0 = time.perf_counter()
            if comm is None:
                all_built = [b for c in colls for b in enumerate_candidates(space, c, args.gpus, args.nodes)[0]]
                comm = Communicator(world, outputs.transport_preset(base_preset, all_built, (), "schedule-measure"),
                                    entries=[])
            measure(comm, cp, coll, bands, by_key, args.dtype, args.reps, say)
            t_measure += time.perf_counter() - t0
        finish(res, measuring)
        results.append(res)
        built_by_coll[coll] = by_key
    device = ""
    if measuring:
        device = device_name(cp)
        comm.close()
    if not lead:
        return 0

    out = Path(args.out)
    with staged_dir(out, "programs") as stage:  # programs and manifest written in full first (a full disk: neither)
        for res in results:
            outputs.write_programs(stage, res, built_by_coll[res.collective])
        manifest = outputs.manifest(results, built_by_coll, base_preset, "schedule-tuned")
        provenance = {"tool": "python -m autotune schedule", "date": _dt.date.today().isoformat(),
                      "measured": measuring, "profile": prof.name, "device": device}
        outputs.write_manifest(stage / "manifest.json", manifest, provenance)
        replace_dir(stage / "programs", out / "programs")
        os.replace(stage / "manifest.json", out / "manifest.json")
    write_atomic(out / "nccl_tuner.conf", outputs.nccl_csv(results, built_by_coll, space.nccl_algorithm,
                                                            args.nodes, args.gpus), "NCCL tuner table")
    written = {"programs": str(out / "programs"), "manifest": str(out / "manifest.json"),
               "nccl_tuner": str(out / "nccl_tuner.conf"), "result": str(out / "schedule.json")}
    if measuring:
        terms = {p: t for res in results for p, t in Correction.from_dict(res.correction).terms.items()}
        corr = Correction(terms, f"autotune schedule on {device}, {_dt.date.today().isoformat()}")
        write_json(out / "model_correction.json", corr.to_dict(), "model correction")
        written["model_correction"] = str(out / "model_correction.json")
    result = TuneResult(date=_dt.date.today().isoformat(), ranks=args.gpus, nodes=args.nodes, gpus_per_node=gpn,
                        profile=prof.name, dtype=args.dtype, space=space.name, measured=measuring,
                        not_measured_reason="" if measuring else reason, device=device,
                        input_correction=correction.to_dict() if correction else {},
                        heldout=declaration.to_dict() if declaration else {},
                        seconds={"model": t_model, "measure": t_measure, "total": time.perf_counter() - t_start},
                        outputs=written, collectives=results)
    result.save(out / "schedule.json")
    for res in results:
        print(report_table(res, measuring))
        for n in res.notes:
            log(f"note: {n}")
    if not measuring:
        print(f"nothing was measured ({reason}): the choices above come from the model alone")
    else:
        print("development figures (the best of the measured candidates per band, at the sizes chosen on): quote "
              f"python -m autotune schedule evaluate {out}/ (held-out sizes {declaration.evaluation})")
    print(f"wrote {out}/ (programs/, manifest.json, nccl_tuner.conf, schedule.json) in "
          f"{result.seconds['total']:.1f} s (measuring {t_measure:.1f} s)")
    return 0 if all(r.correct is not False for res in results for b in res.bands for r in b.rows) else 1


def declare_heldout(colls: list[str], bands, args):
    """The held-out sizes, declared before anything is measured: off the grid, from half the smallest band's
    size to twice the largest's (the table's bands cover every size)."""
    import datetime

    from calibrate.measure.heldout import declare

    reps = [b.rep for b in bands]
    unit = 128 * args.gpus
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return declare("autotune schedule", {c: reps for c in colls}, max(unit, min(reps) // 2), 2 * max(reps),
                   args.heldout, args.heldout_seed, unit, stamp)


# -- python -m autotune schedule evaluate ---------------------------------------------------------
def build_evaluate_parser() -> argparse.ArgumentParser:
    p = command_parser("python -m autotune schedule evaluate",
                       "Confirm a tuned schedule table at the tuning run's held-out sizes (under mpirun, on GPUs).",
                       epilog="""Reads schedule.json (its held-out declaration checked against its hash) and
manifest.json of a measured run and measures, at the held-out sizes only, in this fresh process:
the tuned manifest through the interpreter's selection, NCCL, NCCL's best setting for the size
(from the development sweep of --nccl-run), the run's best fixed configuration and, per knob in
which the tuned choice differs from it, the tuned choice with that knob as fixed, as arms of one
comparison per size (checked before and after the timed replays, medians). Prints each size as
it is done; with --max-seconds, a size that would not finish in time is skipped and recorded as
not measured. Writes schedule_evaluate.json (kind commtune.schedule-evaluate).""")
    p.add_argument("run", help="the tuning run's output directory")
    p.add_argument("--reps", type=int, default=15, help="replays per arm, interleaved (default 15)")
    p.add_argument("--nccl-run", default=None,
                   help="output directory (or nccl_tune.json) of a python -m autotune nccl run on this machine kind: "
                        "NCCL's best setting per size is its table's (chosen from its development sweep); without "
                        "it that arm is a row saying why and the verdicts over it are unknown")
    p.add_argument("--plugin", default=None,
                   help="the NCCL tuner plugin that applies that setting (default: the NCCL run's, else where "
                        "python -m kernels build-tuner puts it)")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="start no held-out size after this many seconds that would, at the slowest size's pace so "
                        "far, end after it; 0: no limit (default 0)")
    p.add_argument("--out", default=None, help="output file (default RUN/schedule_evaluate.json)")
    return p


def _nccl_best_inputs(args, result: TuneResult):
    """(NcclBest, plugin path) of --nccl-run, or (None, None) without it; checked before any GPU work."""
    if not args.nccl_run:
        return None, None
    from kernels.nccl_tuner.build import library

    from autotune.nccl.measure import check_environment
    from autotune.schedule.nccl_best import load_nccl_run

    best = load_nccl_run(args.nccl_run, result.ranks, result.nodes, result.dtype)
    plugin = library(args.plugin or (best.plugin if Path(best.plugin).is_file() else None))
    check_environment(plugin)
    return best, plugin


def evaluate_main(argv) -> int:
    args = build_evaluate_parser().parse_args(argv)
    from calibrate.measure.heldout import Declaration

    run = Path(args.run)
    result = TuneResult.load(run)
    if not result.measured:
        raise UserError(f"{str(run)!r} was not measured (model only): nothing to confirm; tune on GPUs first")
    if not result.heldout:
        raise UserError(f"{str(run)!r} declares no held-out sizes (written before evaluate existed): rerun "
                        f"python -m autotune schedule")
    declaration = Declaration.from_dict(result.heldout, repr(str(run / "schedule.json")))
    if args.reps < 1:
        raise UserError(f"--reps {args.reps}: time at least 1 replay")
    if not args.max_seconds >= 0:
        raise UserError(f"--max-seconds {args.max_seconds}: give seconds >= 0 (0: no limit)")
    manifest_path = run / "manifest.json"
    tuned = load_preset(str(manifest_path))
    best, plugin = _nccl_best_inputs(args, result)
    world, cp, reason = gpu_world(result.ranks)
    if world is None:
        raise UserError(f"cannot evaluate here: {reason}")
    return run_mpi_command(lambda: _evaluate(args, world, cp, result, declaration, tuned, run, best, plugin), world,
                           "autotune schedule evaluate", "what was measured is in schedule_evaluate.json")


def plan_arms(result: TuneResult, declaration, space) -> dict[tuple[str, int], dict]:
    """(collective, held-out size) -> {arm name: the ``Built`` candidate, or why there is none}: the best
    fixed configuration and the knob ablations of the tuned entry serving that size."""
    from autotune.schedule.evaluate import covering, knob_arms

    plans: dict[tuple[str, int], dict] = {}
    for res in result.collectives:
        built, _ = enumerate_candidates(space, res.collective, result.ranks, result.nodes)
        by_key = {b.candidate.key: b for b in built}
        fixed = by_key.get(res.fixed_baseline)
        for n in declaration.evaluation.get(res.collective, []):
            plan: dict = {}
            if res.fixed_baseline:
                plan[f"fixed {res.fixed_baseline}"] = fixed or f"{res.fixed_baseline} is not in space {space.name}"
            key = covering(res.table, n)
            if fixed is not None and key is not None and key in by_key:
                plan.update(knob_arms(by_key[key].candidate, fixed.candidate, by_key, res.collective, result.ranks,
                                      result.nodes))
            plans[(res.collective, n)] = plan
    return plans


def _evaluate(args, world, cp, result: TuneResult, declaration, tuned, run: Path, best, plugin) -> int:
    from calibrate.measure.provenance import command, commit
    from kernels.interp.runtime import Communicator

    from autotune.schedule.evaluate import NCCL_BEST, EvaluateRecord, arms_for, measure_point, summary

    t0 = time.perf_counter()
    lead = world.rank == 0
    plans = plan_arms(result, declaration, load_space(result.space))
    needed = list({id(b): b for p in plans.values() for b in p.values() if not isinstance(b, str)}.values())
    out = Path(args.out) if args.out else run / "schedule_evaluate.json"
    record = EvaluateRecord(date=_dt.datetime.now().isoformat(timespec="seconds"), command=command(),
                            commit=commit(), device=device_name(cp), ranks=result.ranks, dtype=result.dtype,
                            development=str(run / "schedule.json"), heldout=declaration.to_dict(),
                            fixed={c: r.fixed_baseline for c, r in ((r.collective, r) for r in result.collectives)},
                            reps=args.reps, nccl_run=best.to_dict() if best else {})
    todo = [(res.collective, n) for res in result.collectives for n in declaration.evaluation.get(res.collective, [])]
    # no try/finally around the collective work: a rank failing alone would leave the others waiting in a
    # collective clean-up; on an error the process ends (run_mpi_command aborts the job unless every rank raised
    # the same UserError) and the driver releases what it held
    nccl_arms = None
    if best is not None:    # the plugin is loaded with the first NCCL communicator of the process: made after it
        from autotune.nccl.measure import Options, Session
        from autotune.schedule.nccl_best import NcclBestArms

        nccl_arms = NcclBestArms(best, Session(world, cp.cuda.Device().id, plugin, best.min_ctas, result.ranks,
                                               result.nodes, Options(dtype=result.dtype)))
    comm = Communicator(world, outputs.transport_preset(tuned, needed, (), "schedule-evaluate"), entries=[])
    tuned_loaded = [(e, comm.load(e)) for e in tuned.entries]
    loaded = {}
    for b in needed:
        e = outputs.entry_for(b.candidate, b.program.name)
        loaded[id(b)] = [(e, comm.load(e, b.program))]
    stream = cp.cuda.Stream(non_blocking=True)
    slowest = 0.0
    for i, (coll, n) in enumerate(todo):
        t_size = time.perf_counter()
        # rank 0's clock decides for every rank, so that all skip the same sizes
        late = world.bcast(bool(args.max_seconds) and t_size - t0 + slowest > args.max_seconds, root=0)
        if late:
            record.skipped.append({"collective": coll, "bytes": n, "why": f"--max-seconds {args.max_seconds:g} "
                                   f"reached: {t_size - t0:.0f} s so far, the slowest size took {slowest:.0f} s"})
            if lead:
                log(f"[{i + 1}/{len(todo)}] {coll} {n} B: skipped, {record.skipped[-1]['why']}")
            continue
        count = bench_count(coll, n, result.dtype, comm.nranks)
        others = {name: b if isinstance(b, str) else loaded[id(b)] for name, b in plans[(coll, n)].items()}
        ready = {NCCL_BEST: nccl_arms.arm(coll, n) if nccl_arms else UserError(
            "no --nccl-run given: NCCL's best setting comes from a python -m autotune nccl run's sweep")}
        arms, label = arms_for(comm, coll, count, result.dtype, tuned_loaded, others, ready)
        p = measure_point(comm, coll, n, result.dtype, arms, label, args.reps, stream,
                          best.label(coll, n) if best else "")
        record.points.append(p)
        slowest = max(slowest, time.perf_counter() - t_size)
        if lead:
            log(f"[{i + 1}/{len(todo)}] {coll} {n} B in {time.perf_counter() - t_size:.1f} s "
                f"({time.perf_counter() - t0:.0f} s so far): " + ", ".join(
                    f"{a['name']} " + (f"{a['median_s'] * 1e6:.1f} us" if a["status"] == "ok"
                                       else f"{a['status']} ({a['reason']})") for a in p.arms)
                + f"; tuned ran {label}" + (f"; NCCL best ran {p.nccl_best}" if p.nccl_best else ""))
            _save(record, out)
    if nccl_arms is not None:
        nccl_arms.close()
    comm.close()
    record.seconds = {"total": time.perf_counter() - t0}
    if not lead:
        return 0
    record.save(out)
    bad = 0
    for coll, s in summary(record.points, record.skipped).items():
        print(f"{coll} at held-out sizes {s['sizes']}: over NCCL geomean {fmt(s['over_nccl_geomean'], '.3f')}x, "
              f"worst {fmt(s['over_nccl_min'], '.3f')}x; over NCCL's best setting geomean "
              f"{fmt(s['over_nccl_best_geomean'], '.3f')}x, worst {fmt(s['over_nccl_best_min'], '.3f')}x; over "
              f"the best fixed ({s['fixed'] or '-'}) geomean {fmt(s['over_fixed_geomean'], '.3f')}x; "
              f"#wrong {s['wrong']}" + (f"; NOT MEASURED: {'; '.join(s['not_measured'])}" if s["not_measured"] else ""))
        if s["knob_share"]:
            print("  each chosen knob's share (the tuned choice with that knob as the fixed configuration has it, "
                  "over the tuned time): " + ", ".join(f"{k} {fmt(v['share_geomean'], '.3f')}x ({v['timed']}/"
                                                       f"{v['sizes']} sizes)" for k, v in s["knob_share"].items()))
        for v in s["verdicts"]:
            print(f"  target {v['target']}: {v['value']} -> {v['state']}" + (f" ({v['why']})" if v["why"] else ""))
        bad += s["wrong"]
    print(f"wrote {out} in {record.seconds['total']:.0f} s")
    return 1 if bad or record.skipped else 0


def _save(record, out: Path) -> None:
    """Save after each size on rank 0 alone: a failure is said, not raised (the other ranks go on to the next
    size and would wait for this one); the final save raises it."""
    try:
        record.save(out)
    except UserError as e:
        log(f"could not save {out} yet: {e}")


def bench_count(coll: str, nbytes: int, dtype: str, nranks: int) -> int:
    from kernels.interp.bench import count_for

    return count_for(coll, nbytes, pack.DTYPES[dtype], nranks)
