"""``python -m autotune execute``: run a plan's training steps on real devices.

    torchrun --nproc-per-node 2 -m autotune execute out/plan.json --which all --out exec
    mpiexec -n 4 python -m autotune execute plan.json --layers 2 --steps 6
    srun -n 8 python -m autotune execute plan.json
    python -m autotune execute --summarize exec        # the table of a finished run, with the targets
    python -m autotune execute --fit-host d2 d8 t2 t8 --profile p.json --profile-out p-host.json
                                                       # the host's cost per path (autotune.execute.hostfit)

One process per device (NCCL on GPUs, gloo on CPUs). Transformer plans (gpt, llama) run through
autotune.apply: a real nn.Module (the reference modules, models.modules:build, or yours: --module
package.module:factory, called with the plan's model config dict, forward(ids, targets) returning the mean
loss) built on the CPU, placed as the plan says, trained as a user would (each rank its piece of the batch,
fp32 parameters, bf16 autocast where the plan's activations are 16-bit, AdamW) for --steps steps; one result
per plan (measured step time, time in collectives, peak memory per device, losses) beside the plan's
predictions goes into --out. Model flags (--hidden, --heads, ...) are checked against the plan's model;
--layers runs a shorter (or longer) stack of the tied layers. Plans of other models (mlp, vgg,
u-transformer) are not executable.

    torchrun --nproc-per-node 4 -m autotune execute plan.json --module mypkg.model:build

A pipelined plan (python -m autotune --pipeline N) runs through autotune.apply_pipeline: the module cut
into the plan's stages, each rank training its stage under the plan's schedule (autotune.execute.pipetrain).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from calibrate.cli import command_parser, finite_float, seed_int
from calibrate.errors import UserError
from calibrate.jsonfile import write_json
from calibrate.lock import DirLock
from calibrate.outputs import check_output_path, write_atomic
from calibrate.profile import Profile
from models.hf import DEFAULT_MODULE

from autotune.execute import layertable, result
from autotune.execute.launch import check_steps, launch_env
from autotune.execute.planread import APPLY_PATHS, check_kind
from autotune.cli.search import add_model_fields
from autotune.plan.file import PlanFile
from autotune.plan.typed import Plan

DEFAULT_OUT = "execute-out"


def executor(plan: Plan) -> str:
    """apply, or pipeline (a pipelined plan, through autotune.apply_pipeline)."""
    return "pipeline" if plan.stages else "apply"


def parser() -> argparse.ArgumentParser:
    ap = command_parser("python -m autotune execute", __doc__)
    ap.add_argument("plan", nargs="?", help="plan.json written by python -m autotune")
    ap.add_argument("--which", default="best", help="best, all, or baseline:NAME (a baseline whose name starts with NAME)")
    ap.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median step time (default 2)")
    ap.add_argument("--profile-steps", type=int, default=2,
                    help="further steps under the torch profiler for the time in collectives (default 2; 0: none)")
    ap.add_argument("--dtype", default="auto", help="auto (the plan's act_bytes: 2 bf16, 4 fp32), float64, float32, bfloat16")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                    help="auto (cuda where torch sees a GPU, else cpu), cuda or cpu")
    ap.add_argument("--seed", type=seed_int, default=0, help="seed of the weights and the data")
    ap.add_argument("--lr", type=finite_float, default=1e-3, help="Adam learning rate, above 0 (default 1e-3)")
    ap.add_argument("--module", default=DEFAULT_MODULE,
                    help="package.module:factory building the nn.Module from the plan's model config, or the "
                         "Hugging Face config.json the plan was searched for (transformers' class)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the result records (default ./{DEFAULT_OUT})")
    ap.add_argument("--summarize", metavar="DIR",
                    help="print the tables of the results in DIR and write DIR/summary.json, summary.md, breakdown.txt "
                         "(device time by kernel family, memory by phase) and layers.txt (each layer's predicted "
                         "forward and backward beside the measured)")
    ap.add_argument("--apply-path", default="auto", choices=APPLY_PATHS,
                    help="auto: each plan on the path apply takes (DDP, fully_shard, tensor or DTensor); dtensor: "
                         "every plan and pipeline stage placed by DTensor (the host's cost of each path)")
    ap.add_argument("--fit-host", nargs="+", metavar="DIR",
                    help="fit each path's host figures from the results in these folders (two depths and two "
                         "micro-batch counts a path) into --profile, written to --profile-out")
    ap.add_argument("--profile", help="with --fit-host: the profile to add the host figures to")
    ap.add_argument("--profile-out", help="with --fit-host: where to write that profile")
    g = ap.add_argument_group("model (checked against the plan's; --layers runs a stack of that many layers)")
    g.add_argument("--model", help="model kind the plan must be for")
    g.add_argument("--preset", help="preset the plan must be for")
    add_model_fields(g)
    return ap


def check_model(plan: Plan, args) -> None:
    cfg = plan.model
    if args.model and args.model != cfg.kind:
        raise UserError(f"the plan is for a {cfg.kind} model but --model {args.model} was given: "
                        f"drop --model or search a plan for {args.model}")
    if args.preset and args.preset != cfg.get("name"):
        raise UserError(f"the plan is for preset {cfg.get('name')!r} but --preset {args.preset} was given: "
                        f"drop --preset or search a plan for it")
    for key, value in vars(args).items():
        name = key[2:]
        if key.startswith("f_") and value is not None and name != "layers" and cfg.get(name) != value:
            raise UserError(f"the plan's model has {name} {cfg.get(name)!r} but --{name.replace('_', '-')} {value} was "
                            f"given: drop the flag or re-run the search with it")


def write_summary(folder: str | Path) -> tuple[dict, list[dict]]:
    """summary.json (what python -m reports reads), summary.md, breakdown.txt and layers.txt of the records in
    ``folder``; (the summary, the records)."""
    records = result.load_records(Path(folder))
    check_output_path(Path(folder) / "summary.json", "execute summary")  # before the tables, not after them
    s = result.summary(records)
    s["layers"] = {r["strategy"]: rows for r in records if not r.get("error") for rows in (layertable.layer_rows(r),) if rows}
    write_atomic(Path(folder) / "breakdown.txt", result.format_breakdown(records) + "\n", "execute breakdown")
    layers = layertable.format_layers(records)
    if layers:
        write_atomic(Path(folder) / "layers.txt", layers + "\n", "execute layer table")
    write_atomic(Path(folder) / "summary.md", result.markdown(s, f"python -m autotune execute --summarize {folder}"),
                 "execute summary")
    write_json(Path(folder) / "summary.json", s, "execute summary")
    return s, records


def summarize(folder: str) -> int:
    s, records = write_summary(folder)
    print(f"{s['model'].get('name', '')} on {s['cluster']['nodes']}x{s['cluster']['gpus_per_node']} {s['device']} "
          f"({s['backend']}, {s['dtype']})")
    print(result.format_table(s["rows"]))
    print(result.COLUMNS)
    print(result.format_targets(s["targets"]))
    for f in s["failed"]:
        print(f"not measured: {f['strategy']}: {f['error']}")
    print(result.format_breakdown(records))
    layers = layertable.format_layers(records)
    if layers:
        print(layers)
    print(f"wrote {Path(folder) / 'summary.json'} and summary.md")
    return 0


def fit_host(folders: list[str], profile: str | None, out: str | None) -> int:
    from autotune.execute.hostfit import fit_profile, fits, table
    if not profile or not out:
        raise UserError("--fit-host needs --profile (the profile measured on this machine) and --profile-out (where "
                        "to write it with the host figures)")
    target = check_output_path(Path(out), "--profile-out")
    base = Profile.load(profile)
    found, failed = fits(folders)
    print(table(found))
    for why in failed:
        print(f"not fitted: {why}")
    written = fit_profile(base, found, f"python -m autotune execute --fit-host {' '.join(folders)}").save(target)
    print(f"wrote {written}")
    return 0


def device_warning(plan: Plan, here: str) -> str | None:
    """A warning where the plan's predictions come from a profile measured on another device than this
    run's (an H200 profile's step time set against a CPU run is no comparison), else None."""
    try:
        profile = Profile.load(plan.profile)
    except UserError:
        return None
    return other_device(profile, here)


def other_device(profile: Profile, here: str) -> str | None:
    """The warning of ``device_warning`` for a profile loaded, or None where it describes ``here``."""
    if profile.device is None or profile.device.name == here:
        return None
    return (f"warning: the predictions come from profile {profile.name!r}, measured on {profile.device.name}; this "
            f"run is on {here}: for a fair comparison search with a profile measured here (python -m calibrate "
            f"compute)")


def lock_on_rank0(lock: DirLock, lead: bool) -> None:
    """``lock`` taken by rank 0; its refusal raised on every rank (before any of them runs a step)."""
    import torch.distributed as dist

    box = [None]
    if lead:
        try:
            lock.acquire()
        except UserError as e:
            box = [str(e)]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise UserError(box[0])


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    if args.fit_host:
        return fit_host(args.fit_host, args.profile, args.profile_out)
    if not args.plan:
        raise UserError("give a plan.json (python -m autotune execute PLAN), or --summarize DIR")
    check_steps(args.steps, args.warmup, args.profile_steps)
    if args.lr <= 0:
        raise UserError(f"--lr {args.lr:g} is not a learning rate: give one above 0, e.g. 1e-3")
    check_output_path(args.out, "--out folder", directory=True)  # before any step runs, not after them all
    pf = PlanFile.load(args.plan)
    plans = pf.select(args.which)
    launch = launch_env()
    from autotune.execute.runner import plan_cluster
    from autotune.execute.pipetrain import check_pipelined, run_pipeline_plan
    from autotune.execute.usermodule import load_factory
    for plan in plans:
        check_model(plan, args)
        check_kind(plan)
        if executor(plan) == "pipeline":
            check_pipelined(plan, launch.world, args.f_layers)
        else:
            plan_cluster(plan, launch.world)
        load_factory(args.module)
    from autotune.execute.env import start, stop
    from autotune.execute.moduletrain import torch
    from autotune.execute.runner import free_device, out_of_memory_record, run_module_plan
    lead = launch.rank == 0

    def progress(msg):
        if lead:
            print(f"[execute] {msg}", file=sys.stderr, flush=True)

    d = start(args.device)
    lock = DirLock(args.out, "execute output directory")  # two runs into one --out: the second refused
    try:
        lock_on_rank0(lock, lead)
        for i, plan in enumerate(plans):
            progress(f"plan {i + 1}/{len(plans)}: {plan.strategy} on {launch.world} {d.device.type} devices")
            unfair = device_warning(plan, torch.cuda.get_device_name(d.device) if d.is_gpu else "CPU")
            if unfair:
                progress(unfair)
            free_device(d)
            run = run_pipeline_plan if executor(plan) == "pipeline" else run_module_plan
            try:
                rec, model = run(plan, d, module=args.module, apply_path=args.apply_path, layers=args.f_layers,
                                 steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps,
                                 dtype=args.dtype, seed=args.seed, lr=args.lr, progress=progress)
                del model
            except torch.OutOfMemoryError as e:  # this plan does not fit: record it and go on
                rec = out_of_memory_record(plan, d, str(e))
                progress(f"out of memory: {rec['detail']}")
            rec["command"] = "python -m autotune execute " + " ".join(argv if argv is not None else sys.argv[1:])
            rec["plan_file"] = str(args.plan)
            if lead:
                path = result.write_record(Path(args.out), i, rec)
                if "error" not in rec:
                    print(result.format_table(result.rows([rec])).splitlines()[-1], flush=True)
                progress(f"wrote {path}")
            free_device(d)
            if d.is_gpu:
                progress(f"after plan {i + 1}: {torch.cuda.memory_allocated(d.device) / 2**30:.2f} GiB still allocated")
    finally:
        stop(d)
        lock.release()
    if lead:
        print(result.format_table(result.rows(result.load_records(Path(args.out))[-len(plans):])))
        write_summary(args.out)  # the records' summary stored beside them: python -m reports reads the folder
        print(f"wrote {Path(args.out) / 'summary.json'} (python -m reports {args.out} -o report.html)")
    return 0
