"""``python -m autotune``: search per-layer SBP distributions for a model.

    python -m autotune --model gpt                     # default preset, cluster and profile
    python -m autotune --model gpt --preset gpt3-175b --nodes 512 --gpus-per-node 8
    python -m autotune --model mlp --nodes 128 --gpus-per-node 1 --profile piz-daint --search exhaustive
    python -m autotune --model gpt --preset gpt3-175b --nodes 512 --gpus-per-node 8 --pipeline 16 --schedule eager-1f1b

Writes plan.json and report.html into --out (default ./autotune-out).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from calibrate.cli import command_parser, finite_float, message
from calibrate.errors import OptionError, UserError
from calibrate.lock import DirLock
from calibrate.profile import DEFAULT_PROFILE, Profile
from models import CHOICES, FIELDS, HELP, load_model, model_kinds
from models.loader import presets as kind_presets  # models.presets is also the presets' package

from autotune.export import next_steps
from autotune.pipeline.record import pipeline_plans
from autotune.pipeline.search import PipelineConfig, check as check_pipeline, parse_stages
from autotune.plan.hostpace import at_host_pace, corrected
from autotune.sbp.baselines import baseline_plans, best_mesh, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.fit import scaled, search_fitting, search_modes
from autotune.sbp.mesh import Cluster
from autotune.sbp.plan import PlanFile, build_plan, plan_title, summary_lines
from autotune.sbp.search import EXHAUSTIVE_LIMIT, SEARCHES, Budget, auto_budget, make_search

DEFAULT_NODES, DEFAULT_GPUS = 4, 8
DEFAULT_MEMORY_GIB = 80.0
DEFAULT_OUT = "autotune-out"
OBJECTIVE_WORDS = {"step": "predicted step time (compute + communication not hidden; --objective step)",
                   "comm": "communication per step (AutoDDL's objective; --objective comm)"}


# the most one search may be given: a day, or as many steps as about an hour of the fastest search
MAX_BUDGET_S = 86_400.0
MAX_BUDGET_STEPS = 100_000_000
SEEDS = 2**32  # numpy's generators take seeds in [0, 2**32)


def graph_note(config: dict) -> str:
    """A word where the model is AutoDDL's graph rather than a transformer as users write it (the gpt kind's
    default preset is AutoDDL's, and size flags keep the preset's other fields)."""
    odd = [w for w, on in (("attention naive", config.get("attention") == "naive"),
                           ("no residual stream", config.get("residual") is False)) if on]
    if not odd:
        return ""
    return (f" (AutoDDL's graph: {', '.join(odd)}; a transformer as users write it: --preset gpt2, or "
            f"--attention flash --residual true)")

def parse_budget(text: str) -> Budget:
    t = text.strip().lower()
    try:
        budget = Budget(steps=int(t[:-5])) if t.endswith("steps") else Budget(seconds=float(t.rstrip("s")))
    except ValueError:
        raise UserError(f"bad --budget {text!r}: give seconds (e.g. 5) or steps (e.g. 2000steps)") from None
    if (budget.seconds or 0) > MAX_BUDGET_S or (budget.steps or 0) > MAX_BUDGET_STEPS:
        raise UserError(f"--budget {text!r} is over the limit of {MAX_BUDGET_S:,.0f} s or {MAX_BUDGET_STEPS:,} steps "
                        f"per search: give a smaller budget, or none to stop when the search converges")
    return budget


def parser() -> argparse.ArgumentParser:
    ap = command_parser("python -m autotune", __doc__)
    ap.add_argument("--model", default="gpt",
                    help=f"model kind ({', '.join(model_kinds())}), or a file (a name ending in .json or holding a "
                         f"path separator): a model JSON or a Hugging Face config.json (default gpt)")
    ap.add_argument("--preset", help="preset of the model kind (default: the kind's default, first below): " + "; ".join(
        f"{kind}: {', '.join([kind_presets(kind)[0]] + [n for n in kind_presets(kind)[1] if n != kind_presets(kind)[0]])}"
        for kind in model_kinds()))
    ap.add_argument("--nodes", type=int, default=None, help=f"nodes (default {DEFAULT_NODES})")
    ap.add_argument("--gpus-per-node", type=int, default=None, help=f"GPUs per node (default {DEFAULT_GPUS})")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help=f"fitted profile name or JSON file (default {DEFAULT_PROFILE})")
    ap.add_argument("--search", default="cd", choices=sorted(SEARCHES), help="search algorithm (default cd)")
    ap.add_argument("--budget", default=None,
                    help="time (seconds) or steps ('2000steps') per search (default: until converged, i.e. restarts "
                         "in a row find nothing cheaper or the relaxation's lower bound is reached, at most 1 s + "
                         "1.5 ms per strategy, 2 to 20 s; comparison runs get the main search's time, at most 3 s)")
    ap.add_argument("--memory-limit", type=finite_float, default=None,
                    help="GiB per device, a hard constraint on a plan's peak, workspace included (default: the "
                         f"profile's usable GPU memory, else {DEFAULT_MEMORY_GIB:g})")
    ap.add_argument("--modes", choices=("all", "none"), default="all",
                    help="'all': also search with FSDP and, where memory binds, recomputation (selective, full), "
                         "keeping the cheapest plan that fits; 'none': no recomputation, no FSDP")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"directory for plan.json and report.html (default ./{DEFAULT_OUT})")
    ap.add_argument("--objective", choices=("step", "comm"), default=None,
                    help="what the search minimises: 'step', predicted step time (compute + the communication "
                         "not hidden), or 'comm', all communication per step (AutoDDL's); default step when "
                         "the profile has compute figures, else comm")
    ap.add_argument("--seed", type=int, default=0, help=f"seed of the randomised searches, 0 to {SEEDS - 1}")
    ap.add_argument("--pipeline", default="auto",
                    help="pipeline stages: 'auto' (tried, kept when faster than the best single-stage plan; needs "
                         "the step objective), 'off', or a stage count (default auto)")
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedule: 1f1b, gpipe or eager-1f1b (default 1f1b)")
    ap.add_argument("--pipeline-effort", choices=("default", "full"), default="default",
                    help="the stage searches' effort: 'default' (capped restarts and relaxation rounds, the split "
                         "DP for the fastest candidate: within 0.02%% of full effort on the benchmark cases, "
                         "reports/records/pipeline.md) or 'full' (slower)")
    ap.add_argument("--compare", default="cd,mh,random",
                    help="algorithms run for the convergence plot, each on the budget (default cd,mh,random; "
                         "exhaustive is added when the space is small); 'none' to skip")
    add_model_fields(ap.add_argument_group("model fields (override the preset)"))
    return ap


def add_model_fields(g) -> None:
    """Every model kind's fields as options of ``g`` (dest ``f_<name>``, each with its type and help)."""
    seen = set()
    for kind, fields in FIELDS.items():
        for name, typ in fields.items():
            if name in seen:
                continue
            seen.add(name)
            flag = "--" + name.replace("_", "-")
            kinds = ", ".join(k for k in FIELDS if name in FIELDS[k])
            common = dict(dest=f"f_{name}", default=None, help=f"{HELP[name]} ({kinds})")
            if typ == "int":
                g.add_argument(flag, type=int, metavar="N", **common)
            elif typ == "bool":
                g.add_argument(flag, type=true_or_false, metavar="true|false", **common)
            elif typ == "str":
                g.add_argument(flag, choices=CHOICES[name], **common)
            else:
                g.add_argument(flag, type=lambda s: [int(x) for x in s.split(",")], metavar="N,N,...", **common)


def true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() == "true"


def progress(msg: str) -> None:
    print(f"[autotune] {msg}", file=sys.stderr, flush=True)


def run_search(problem: Problem, name: str, budget: Budget | None, seed: int, start=None):
    """``budget`` None: ``auto_budget`` (until converged, scaled with the problem)."""
    budget = budget or auto_budget(problem)
    progress(f"search {name} (budget {budget.describe()}"
             f"{', warm-started (the best Megatron plan, or the best plan of an earlier mode)' if start is not None else ''})")
    problem.forget_lazy()
    res = make_search(name, progress).run(problem, budget, np.random.default_rng(seed), start)
    progress(f"  {name}: best {res.cost:.4g} s/step after {res.seconds:.2f} s, {res.steps} steps; stopped: {res.stopped}")
    return res


def pipeline_config(stages, args) -> PipelineConfig:
    """The pipeline search's settings from the command's flags."""
    cfg = PipelineConfig(stages, args.schedule, search=args.search, seed=args.seed)
    return cfg.full_effort() if args.pipeline_effort == "full" else cfg


def table(plans: list[dict]) -> str:
    step = all("step_s" in p["totals"] for p in plans)
    rows = [("strategy", "redistribution s", "grad sync s", "comm s/step")
            + (("compute s", "step s") if step else ()) + ("memory GiB", "search s")]
    for p in plans:
        t = p["totals"]
        fits = t["fits_memory"]
        over = f"no plan fits (needs {t['memory_bytes'] / 2**30:.4g} GiB)"
        row = (p["strategy"], f"{t['redistribution_s']:.4g}", f"{t['grad_sync_s']:.4g}",
               f"{t['total_s']:.4g}" if fits or step else over)
        if step:
            row += (f"{t['compute_s']:.4g}", f"{t['step_s']:.4g}" if fits else over)
        rows.append(row + (f"{t['memory_bytes'] / 2**30:.2f}",
                           f"{p['search']['seconds']:.2f}" if "seconds" in p["search"] else "-"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows)


def memory_limit(profile, gib: float | None) -> tuple[float, str]:
    """Bytes per device: ``gib`` if given, else the profile's usable GPU memory, else the default (with a
    note saying which)."""
    if gib is not None:
        return gib * 2**30, ""
    usable = getattr(profile, "memory_bytes", None)
    frag = (getattr(getattr(profile, "module", None), "memory", None) or {}).get("fragmentation", 0.0)
    if usable and frag:  # the allocator's fragmentation measured by calibrate module: an allowance under the limit
        return float(usable) / (1 + frag), (f" (profile {profile.name}'s usable GPU memory less the allocator's "
                                            f"fragmentation, {frag * 100:.1f}% of what is allocated)")
    if usable:
        return float(usable), f" (profile {profile.name}'s usable GPU memory)"
    print(f"note: profile {profile.name!r} does not give its GPU memory: memory limit {DEFAULT_MEMORY_GIB:g} GiB "
          "(set it with --memory-limit)")
    return DEFAULT_MEMORY_GIB * 2**30, " (default)"


FLOOR = ("data parallel", "Megatron", "FSDP", "HSDP", "TP+FSDP")  # baselines of the searched problem's family


def floor(plan: dict, baselines: list[dict], objective: str) -> dict:
    """The searched plan, or the cheapest baseline of ``FLOOR`` that fits where it is cheaper: the command
    never returns a plan worse than a baseline users pick."""
    key = "step_s" if objective == "step" else "total_s"
    fit = [b for b in baselines if b["strategy"].startswith(FLOOR) and b["totals"]["fits_memory"] and key in b["totals"]
           and b["totals"][key] < plan["totals"][key]]
    if not plan["totals"]["fits_memory"] or not fit:
        return plan if not fit else dict(min(fit, key=lambda b: b["totals"][key]))
    b = min(fit, key=lambda b: b["totals"][key])
    host = plan["totals"].get("host_step_s")  # the search's plan priced at its path's host pace, where it binds
    why = f" at the host's pace of the {plan['apply_path']} path it takes" if host is not None and \
        host >= plan["totals"][key] else ""
    return dict(b, strategy=f"searched (the baseline {b['strategy']} is cheaper than the search's plan{why})",
                search=dict(plan["search"], replaced_by=b["strategy"]))


def breakdown(plan: dict) -> str:
    """The searched plan's memory per device by kind, its recomputation and sharding, in one line each."""
    m = plan["totals"]["memory"]
    parts = [("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"), ("optimizer states", "optimizer_bytes"),
             ("activations", "activations_bytes"), ("workspace", "workspace_bytes")]
    sh = plan.get("sharding", {"mode": "none"})
    # + 0.0: a figure that rounds to zero prints 0.00, not -0.00
    return (f"searched plan's memory per device: " + ", ".join(f"{name} {round(m[k] / 2**30, 2) + 0.0:.2f}"
                                                               for name, k in parts)
            + f" GiB; total {plan['totals']['memory_bytes'] / 2**30:.2f} GiB\n"
            + f"recompute {plan.get('recompute', 'none')}; sharding "
            + (f"fsdp over axes {sh['axes']}" if sh["mode"] == "fsdp" else "none"))


def main(argv=None, report=None) -> int:
    """The search; ``report(plan_path, title)``, given by the command layer, writes the HTML report."""
    args = parser().parse_args(argv)
    budget = parse_budget(args.budget) if args.budget is not None else None
    if not 0 <= args.seed < SEEDS:
        raise UserError(f"--seed {args.seed} is out of range: give a whole number from 0 to {SEEDS - 1}")
    compare = [] if args.compare == "none" else [c.strip() for c in args.compare.split(",") if c.strip()]
    for name in compare:
        if name not in SEARCHES:
            raise UserError(f"unknown search {name!r} in --compare: use some of {', '.join(SEARCHES)}, or none")
    overrides = {k[2:]: v for k, v in vars(args).items() if k.startswith("f_") and v is not None}
    graph = load_model(args.model, args.preset, overrides)
    for flag, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if v is not None and v < 1:
            raise UserError(f"{flag} {v} must be at least 1: give the cluster's {flag[2:].replace('-', ' ')}")
    nodes = DEFAULT_NODES if args.nodes is None else args.nodes
    gpus = DEFAULT_GPUS if args.gpus_per_node is None else args.gpus_per_node
    cluster = Cluster(nodes, gpus)
    stages = parse_stages(args.pipeline)
    check_pipeline(graph, cluster, stages, args.schedule)
    profile = Profile.load(args.profile)
    if args.memory_limit is not None and args.memory_limit <= 0:
        raise UserError("--memory-limit must be positive (GiB per device)")
    limit, limit_note = memory_limit(profile, args.memory_limit)
    out = Path(args.out)
    try:  # an unwritable --out is found before the search, not after it
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create --out {str(out)!r} ({e.strerror}): give a writable directory") from None
    with DirLock(out, "search output directory"):  # two searches into one --out: the second is refused
        default_note = " (default cluster)" if args.nodes is None and args.gpus_per_node is None else ""
        print(f"model {graph.model} {graph.config.get('name', '')}: {graph.parameters() / 1e9:.2f}B parameters, "
              f"batch {graph.batch} in {graph.micro_batches} micro-batches{graph_note(graph.config)}")
        print(f"cluster {cluster}{default_note}; profile {profile.name}"
              f"{' (default profile)' if args.profile == DEFAULT_PROFILE else ''}; "
              f"memory limit {limit / 2**30:.4g} GiB per device{limit_note}", flush=True)
        objective = args.objective
        if objective is None and args.search in ("exhaustive", "dp"):
            objective = "comm"
            print(f"note: --search {args.search} sums per-layer costs, which only the communication objective does: "
                  f"minimising communication (--objective comm)")
        if objective is None:
            objective = "step" if profile.compute is not None else "comm"
            if profile.compute is None:
                print(f"note: profile {profile.name!r} has no compute figures: minimising communication "
                      f"(--objective comm); add them with python -m calibrate compute")
        print(f"objective: {OBJECTIVE_WORDS[objective]}", flush=True)
        if stages != "off" and objective != "step":
            if stages != "auto":
                raise UserError("pipeline stages are timed by the step objective: use --objective step with a profile "
                                "that has compute figures, or --pipeline off")
            stages = "off"
        t0 = time.perf_counter()
        coster = Coster(profile, cluster)
        problem = plain = Problem(graph, coster, limit, progress=progress, objective=objective, require_fit=False)
        mega, mega_cost, _ = best_mesh(problem, megatron_assignment)
        warm = mega if mega is not None and np.isfinite(mega_cost) else None

        def run(pr, start, share=1.0):
            return run_search(pr, args.search, scaled(budget or auto_budget(pr), share), args.seed, start)
        if args.modes == "all":
            problem, best = search_modes(problem, run, warm, progress)
        else:
            problem.require_fit()
            best = search_fitting(problem, run, warm)
        if best is None or not problem.fits_plan(best.assignment):
            least = min(p.min_memory for p in plain.mode_problems())
            raise OptionError("memory_limit", f"{limit / 2**30:.4g} GiB per device: no plan fits it with its workspace "
                                              f"under any recomputation or FSDP, the smallest needs {least / 2**30:.4g} "
                                              "GiB before its workspace; raise it, add devices or shrink the micro-batch")
        traces = {best.algorithm: best.trace}
        space = float(np.prod([float(n) for n in problem.sizes]))
        if space <= 1e8 and "exhaustive" not in compare and objective == "comm":
            compare.append("exhaustive")
        for name in compare:
            if name == args.search:
                continue
            if name in ("exhaustive", "dp") and (space > EXHAUSTIVE_LIMIT or objective != "comm"):
                progress(f"skip {name}: {space:.2e} plans" if objective == "comm" else
                         f"skip {name}: it sums per-layer costs, which the step objective is not")
                continue
            # cold start, for the convergence plot; by default on the main search's time (at most 3 s)
            other = run_search(problem, name, budget or Budget(seconds=min(3.0, max(best.seconds, 0.1))), args.seed)
            traces[other.algorithm] = other.trace
            if other.cost < best.cost and problem.fits_plan(other.assignment):
                progress(f"  {name} found a cheaper plan than {best.algorithm}; keeping it")
                best = other
        sb_problem = Problem(graph, coster, limit, allow_partial=False, require_fit=False, objective=objective)
        try:
            summa_problem = Problem(graph, coster, limit, signatures=("summa",), require_fit=False, objective=objective)
        except UserError as e:
            progress(f"SUMMA baseline unavailable: {message(e)}")
            summa_problem = None
        progress("baselines: data parallel, Megatron (every mesh), FSDP, HSDP, TP+FSDP (each at its best recomputation), "
                 "SUMMA (every mesh), S/B only")
        plan = build_plan(problem, best.assignment, f"searched ({best.algorithm})",
                          {"algorithm": best.algorithm, "seconds": best.seconds, "steps": best.steps, "stopped": best.stopped})
        skipped: list[str] = []
        base = baseline_plans(plain, summa_problem, sb_problem,
                              lambda p: run_search(p, args.search, budget, args.seed), skipped)
        if objective == "step":  # each plan's step at the host's pace of its path, where the profile says it
            plan, base = (at_host_pace(plan, profile.compute, profile.module),
                          [at_host_pace(b, profile.compute, profile.module) for b in base])
            # and corrected by what autotune tune measured on this machine, per path (the profile's residuals)
            plan, base = corrected(plan, profile), [corrected(b, profile) for b in base]
        plan = floor(plan, base, objective)
        if stages != "off":
            progress(f"pipeline stages ({'every stage count' if stages == 'auto' else stages}, {args.schedule})")
            piped, mega3d = pipeline_plans(graph, cluster, profile, limit,
                                           pipeline_config(stages, args),
                                           progress)
            base += [x for x in (mega3d,) if x is not None]
            fits = piped is not None and piped["totals"].get("fits_memory", False) and (
                limit is None or piped["totals"]["memory_bytes"] <= limit)
            if fits and (not plan["totals"]["fits_memory"] or piped["totals"]["step_s"] < plan["totals"]["step_s"]):
                base.insert(0, dict(plan, strategy=f"best single-stage: {plan['strategy']}"))
                plan = piped
            elif piped is not None:
                base.append(piped)
        pf = PlanFile(plan, base, {k: [list(x) for x in v] for k, v in traces.items()},
                      {"command": "python -m autotune " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "wall_s": time.perf_counter() - t0, "objective": objective})
        path = pf.save(out / "plan.json")
        rep = report(path, plan_title(plan)) if report else None
        print(table([plan] + base))
        if "pipeline" in plan:
            pl, t = plan["pipeline"], plan["totals"]
            sub = pl["submesh"]
            print(f"pipeline: {pl['stages']} stages of {sub['nodes']} x {sub['gpus_per_node']} GPUs, {pl['schedule']}, "
                  f"{pl['micro_batches']} micro-batches, blocks per stage {pl['split']}; bubble {t['bubble_s']:.4g} s, "
                  f"boundaries {t['boundary_s'] * 1e3:.3g} ms per micro-batch in all")
        if skipped:
            print(f"no plan of {', '.join(skipped)} here: some layer cannot take its placement (e.g. the attention's "
                  f"micro-batch x heads does not cover the {cluster.devices} devices)")
        print(breakdown(plan))
        print("\n".join(summary_lines(plan, base, objective)))
        print(f"wrote {path}" + (f" and {rep}" if rep else ""))
        print("\n".join(next_steps(path, plan)))
        return 0
