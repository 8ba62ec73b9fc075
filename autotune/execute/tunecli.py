"""``autotune tune``: search, confirm the best candidates by measurement, return the measured fastest.

    torchrun --nproc-per-node 4 -m autotune tune --model config.json --out tune-out
    torchrun --nproc-per-node 4 -m autotune tune --model model.json --module pkg.mod:factory --profile p.json
    torchrun --nproc-per-node 2 -m autotune tune --model config.json --k 3 --steps 5 -- --batch 32 --micro-batch 16

The search runs on rank 0 (the search's own options after ``--``: sequence, batch, memory limit, ...) for the
launched devices (one node of them), then every rank runs the candidates (``autotune.execute.tune``). Written
into --out: plan.json (best: the measured fastest; meta.tune: every candidate's predicted and measured step and
memory), tune.md (the same table, written after each candidate), report.html; and, where the run was on the device
the profile describes, the profile with its residuals (--profile-out, default the --profile file itself where it is
one, else --out/profile.json). A tune stopped part-way (^C, or the SIGTERM of a time limit, which torchrun passes to
its workers) writes them of the candidates it ran, says so (meta.tune.interrupted) and exits 130.
"""
from __future__ import annotations

import datetime as _dt
import signal
import sys
import time
from pathlib import Path

from calibrate.cli import command_parser, message
from calibrate.errors import UserError
from calibrate.outputs import check_output_path, write_atomic
from calibrate.profile import DEFAULT_PROFILE, Profile
from calibrate.residuals import fitted
from models.hf import default_module
from models.loader import check_model

from autotune.execute.cli import other_device
from autotune.execute.launch import check_steps, launch_env
from autotune.execute.usermodule import load_factory
from autotune.plan.hostpace import STEP_MODEL


def parser():
    ap = command_parser("python -m autotune tune", __doc__)
    ap.add_argument("--model", required=True, help="a Hugging Face config.json, a model JSON, or a model kind")
    ap.add_argument("--module", default=None, help="package.module:factory building the nn.Module from the plan's "
                                                    "model config (default: transformers' class of a config.json "
                                                    "--model, else the reference modules)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="the profile calibrate compute wrote on this machine")
    ap.add_argument("--profile-out", default=None, help="where to write the profile with the residuals")
    ap.add_argument("--k", type=int, default=4, help="candidates to run (default 4)")
    ap.add_argument("--steps", type=int, default=4, help="steps per candidate (default 4)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the median (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--out", default="tune-out", help="folder for plan.json, tune.md, report.html")
    ap.add_argument("search", nargs="*", help="after --: the search's own options")
    return ap


def main(argv=None, report=None) -> int:
    args = parser().parse_args(argv)
    check_steps(args.steps, args.warmup, 0)
    if args.k < 1:
        raise UserError(f"--k {args.k}: run at least one candidate")
    check_model(args.model)
    args.module = args.module or default_module(args.model)
    load_factory(args.module)
    launch = launch_env()
    profile = Profile.load(args.profile)
    out = check_output_path(args.out, "--out folder", directory=True)  # before the search, not after the runs
    target = Path(args.profile_out) if args.profile_out else \
        Path(args.profile) if Path(args.profile).suffix == ".json" else out / "profile.json"
    from autotune.execute.env import start, stop
    from autotune.execute.moduletrain import BuildOnce, torch
    from autotune.execute.tune import candidates, fastest, run_candidate, search_plans, tune_table
    from dataclasses import replace

    from autotune.plan.file import PlanFile
    lead = launch.rank == 0

    def progress(msg):
        if lead:
            print(f"[tune] {msg}", file=sys.stderr, flush=True)

    began = time.perf_counter()
    rows, cands, interrupted = [], [], False
    restore = _interrupt_on_sigterm()  # torchrun passes a timeout's SIGTERM on: handled as ^C, below
    d = start(args.device)
    here = torch.cuda.get_device_name(d.device) if d.is_gpu else "CPU"
    warning = other_device(profile, here)
    if warning:
        progress(warning)
    try:
        shared = ["", None]
        if lead:
            try:  # the search's refusals (a profile without host figures, ...) reach every rank as one line
                shared[1] = search_plans(["--model", args.model, "--profile", args.profile, "--nodes", "1",
                                          "--gpus-per-node", str(launch.world), *args.search], progress)
            except UserError as e:  # a search option spelled as given after --
                shared[0] = message(e)
        torch.distributed.broadcast_object_list(shared, src=0)  # the plans themselves: no shared file system
        if shared[0]:
            raise UserError(shared[0])
        pf = shared[1]
        cands = candidates(pf.best, pf.baselines, args.k)
        progress(f"{len(cands)} candidates after {time.perf_counter() - began:.1f} s (set-up and search): "
                 + "; ".join(c.strategy for c in cands))
        build = BuildOnce(launch.local_world,  # the model built once a process
                          init=d.device if d.is_gpu else None)
        for c in cands:
            rows.append(run_candidate(c, d, args.module, args.steps, args.warmup, args.seed, progress, build))
            if lead:  # each candidate's figures kept as measured: an interrupted tune loses none of them
                out.mkdir(parents=True, exist_ok=True)
                write_atomic(out / "tune.md", f"# autotune tune (stopped after {len(rows)} of {len(cands)} "
                                              f"candidates)\n\n{tune_table(rows, None)}\n", "tune table")
    except KeyboardInterrupt:  # ^C, or a time limit's SIGTERM: what was measured is kept (below)
        interrupted = True
    finally:
        if restore is not None:
            signal.signal(signal.SIGTERM, restore)
        keep = interrupted and lead and any(r["status"] == "ok" for r in rows)
        if not keep:
            stop(d)  # an interrupted lead writes what it measured first: peers may be gone
    if not lead:
        return 130 if interrupted else 0
    if interrupted and not keep:
        print(f"interrupted after {len(rows)} of {len(cands) or '?'} candidates, none measured: nothing written")
        return 130
    chosen = fastest(rows)
    table = tune_table(rows, chosen)
    plan = cands[rows.index(chosen)]
    others = [p for p in [pf.best, *pf.baselines] if p is not plan]
    stopped = f"interrupted after {len(rows)} of {len(cands)} candidates" if interrupted else None
    tuned = PlanFile(replace(plan, tune={"returned": True, **chosen}), others, pf.traces,
                     dict(pf.meta, tune={"candidates": rows, "returned": chosen["strategy"], "module": args.module,
                                         "steps": args.steps, "warmup": args.warmup, "world": launch.world,
                                         **({"interrupted": stopped} if stopped else {})}))
    out.mkdir(parents=True, exist_ok=True)
    path = tuned.save(out / "plan.json")
    write_atomic(out / "tune.md", f"# autotune tune{f' ({stopped})' if stopped else ''}\n\n{table}\n", "tune table")
    if report is not None:
        report(path, f"autotune tune: {chosen['strategy']}")
    print(table)
    print(f"{stopped + ': ' if stopped else ''}returned: {chosen['strategy']} ({chosen['measured_step_s'] * 1e3:.2f} "
          f"ms measured{', the fastest of those run' if stopped else ''}); wrote {path}, {out / 'tune.md'}; "
          f"{residuals_note(profile, here, rows, target, launch.world, args.module)}")
    if interrupted:
        stop(d)
        return 130
    return 0


def _interrupt_on_sigterm():
    """SIGTERM raised as KeyboardInterrupt in this (main) thread; the handler it replaced, or None where none
    could be set (not the main thread)."""
    def interrupt(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:
        return None


def residuals_note(profile: Profile, here: str, rows: list[dict], target: Path, world: int, module: str) -> str:
    """The candidates' residuals (measured / predicted per path) written into the profile at ``target``, where the
    run was on the device the profile describes: a run elsewhere (a CPU, another GPU) would correct the next
    search's prices on the profile's device by another device's ratios. What was done, as a line."""
    from autotune.execute.tune import residual_runs
    if other_device(profile, here):
        return (f"residuals not written: the profile describes {profile.device.name}, this run was on {here} "
                f"(tune with a profile measured here, python -m calibrate compute, to correct its prices)")
    stamp = _dt.datetime.now().isoformat(timespec="seconds")
    profile.residuals = fitted(residual_runs(rows), f"autotune tune, {stamp}, {world} processes, {module}",
                               profile.residuals, STEP_MODEL)
    return f"residuals per path {profile.residuals.paths} into {profile.save(target)}"
