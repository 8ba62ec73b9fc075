"""``python -m autotune``: search per-layer SBP distributions for a model (the command around the library
call ``autotune.search``, ``autotune.planner``: it parses the flags, prints and writes).

    python -m autotune --model gpt                     # default preset, cluster and profile
    python -m autotune --model gpt --preset gpt3-175b --nodes 512 --gpus-per-node 8
    python -m autotune --model mlp --nodes 128 --gpus-per-node 1 --profile piz-daint --search exhaustive
    python -m autotune --model gpt --preset gpt3-175b --nodes 512 --gpus-per-node 8 --pipeline 16 --schedule eager-1f1b

Writes plan.json and report.html into --out (default ./autotune-out).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from calibrate.cli import command_parser, finite_float
from calibrate.errors import UserError
from calibrate.lock import DirLock
from calibrate.jsonfile import dumps
from calibrate.outputs import check_utf8, staged, write_atomic, write_together
from calibrate.profile import DEFAULT_PROFILE, Profile
from models import CHOICES, FIELDS, HELP, load_model, model_kinds
from models.hf import DEFAULT_MODULE, default_module, is_hf_file
from models.loader import presets as kind_presets  # models.presets is also the presets' package

from autotune.export import next_steps
from autotune.pipeline.search import PipelineConfig, check as check_pipeline, parse_stages
from autotune.planner import accumulation_choices, choose_objective, search
from autotune.sbp.mesh import Cluster
from autotune.plan.file import plan_title, summary_lines
from autotune.plan.hostpace import STEP_MODEL, current_residuals
from autotune.sbp.search import SEARCHES, Budget

DEFAULT_NODES, DEFAULT_GPUS = 4, 8
DEFAULT_MEMORY_GIB = 80.0
MAX_MEMORY_GIB = 2**20  # 1 PiB per device: far above any GPU, and its bytes stay finite
DEFAULT_SCHEDULE = "1f1b"
DEFAULT_VIRTUAL = PipelineConfig.virtual_stages
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
    ap.add_argument("--expandable-segments", action="store_true",
                    help="the job runs under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's launcher "
                         "sets it): keep the allocator's smaller allowance under the memory limit (the profile's "
                         "figure for them); apply then refuses a job without that setting")
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
    ap.add_argument("--schedule", default=None, help="pipeline schedule: 1f1b, gpipe, eager-1f1b or interleaved-1f1b "
                         "(Megatron-LM's virtual stages, --virtual-stages chunks a rank) (default 1f1b)")
    ap.add_argument("--virtual-stages", type=int, default=None,
                    help="chunks a rank under --schedule interleaved-1f1b (Megatron-LM's virtual pipeline stages; "
                         "default 2)")
    ap.add_argument("--context-parallel", default="auto",
                    help="context-parallel sizes of the Megatron and FSDP plans with it (Megatron-LM's "
                         "--context-parallel-size: each sequence split over that many data-parallel ranks), "
                         "comma-separated; 'auto': 2, 4, 8 and 16 where they divide the devices, for sequences of "
                         "32768 tokens or more; 1: none (default auto)")
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


def table(plans: list) -> str:
    step = all(p.costs.step_s is not None for p in plans)
    rows = [("strategy", "redistribution s", "grad sync s", "comm s/step")
            + (("compute s", "step s") if step else ()) + ("memory GiB", "search s")]
    for p in plans:
        t = p.costs
        over = f"no plan fits (needs {t.memory_bytes / 2**30:.4g} GiB)"
        row = (p.strategy, f"{t.redistribution_s:.4g}", f"{t.grad_sync_s:.4g}",
               f"{t.total_s:.4g}" if t.fits_memory or step else over)
        if step:
            row += (f"{t.compute_s:.4g}", f"{t.step_s:.4g}" if t.fits_memory else over)
        rows.append(row + (f"{t.memory_bytes / 2**30:.2f}",
                           f"{p.search['seconds']:.2f}" if "seconds" in p.search else "-"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows)


def memory_limit(profile, gib: float | None, allocator: str = "default") -> tuple[float, str]:
    """Bytes per device: ``gib`` if given, else the profile's usable GPU memory less the allocator's allowance
    (``allocator``'s), else the default (with a note saying which). The default allocator's allowance is the one
    measured on the user's module where calibrate module ran under it (the step's peak reserved over its peak
    allocated); under expandable segments that gap overstates what the step needs under a cap (3-10% against
    1.3-2.6%: reports/records/published.md, session 20), so the profile's measured allowance is kept."""
    if gib is not None:
        return gib * 2**30, ""
    usable = profile.memory_bytes_under(allocator) if hasattr(profile, "memory_bytes_under") else None
    memory = getattr(getattr(profile, "module", None), "memory", None) or {}
    frag = memory.get("fragmentation") if allocator == memory.get("allocator", "default") == "default" else None
    words = "" if allocator == "default" else ", under expandable segments"
    if usable and frag is not None:  # the allocator's fragmentation measured by calibrate module on the user's
        # module: the allowance under the device's usable memory, in place of the profile's own
        return float(profile.device.usable_bytes) / (1 + frag), (
            f" (profile {profile.name}'s usable GPU memory less the allocator's fragmentation measured on your "
            f"module, {frag * 100:.1f}% of what is allocated)")
    if usable:
        stated = profile.fragmentation_under(allocator) is not None or allocator == "default"
        return float(usable), (f" (profile {profile.name}'s usable GPU memory{words}" + (
            ")" if stated else ": the profile states no allowance for them, the default allocator's kept)"))
    print(f"note: profile {profile.name!r} does not give its GPU memory: memory limit {DEFAULT_MEMORY_GIB:g} GiB "
          "(set it with --memory-limit)")
    return DEFAULT_MEMORY_GIB * 2**30, " (default)"


def host_note(plan, objective: str, devices: int, profile: str, compute=None) -> str | None:
    """The warning a plan on the tensor or DTensor path gets where its host cost is the reference block's (no module
    section of the user's model): those paths' steps are the host's. On the tensor path also where ``compute`` (the
    profile's compute section) has no figure outside the blocks (``host_outside_s``: the embeddings and loss split
    by vocabulary, measured by calibrate compute among 2 GPUs)."""
    if objective != "step" or devices < 2 or plan.apply_path not in ("tensor", "dtensor") \
            or plan.compute_source != "analytical":
        return None
    outside = plan.apply_path == "tensor" and compute is not None and not compute.host_outside_s
    return (f"note: the {plan.apply_path} path's host cost is priced from calibrate's reference block, not your "
            f"model's" + (", and this profile has no figure of that path outside the blocks (the embedding, head and "
                          "loss split by vocabulary, which python -m calibrate compute measures on 2 GPUs)"
                          if outside else "")
            + f"; this path's step is the host's (reports/records/plans_h200x2.md: Megatron t=2 on a Llama ran "
            f"host-bound at 1.5x its price): calibrate your module on this machine (python -m calibrate module "
            f"--model config.json --profile {profile} --out profile.json) and search with it, or confirm the "
            f"candidates with autotune tune")


def breakdown(plan) -> str:
    """The searched plan's memory per device by kind, its recomputation and sharding, in one line each."""
    m = plan.costs.memory
    parts = [("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"), ("optimizer states", "optimizer_bytes"),
             ("activations", "activations_bytes"), ("workspace", "workspace_bytes")]
    # + 0.0: a figure that rounds to zero prints 0.00, not -0.00
    binding = plan.costs.memory_stage
    whose = "searched plan's" if binding is None else \
        f"searched plan's binding stage ({binding} of {len(plan.stages)}: the most memory)"
    # below zero: the peak comes before every gradient exists (one micro-batch: ``memory.peak_workspace``)
    early = " (below zero: not every gradient exists yet at the peak)" if m["workspace_bytes"] < -2**29 else ""
    return (f"{whose} memory per device: " + ", ".join(f"{name} {round(m[k] / 2**30, 2) + 0.0:.2f}"
                                                       for name, k in parts)
            + f" GiB{early}; total {plan.costs.memory_bytes / 2**30:.2f} GiB\n" + modes_line(plan))


def _modes(p) -> str:
    blocks = f" (the first {p.recompute_blocks} blocks)" if p.recompute_blocks else ""
    return f"recompute {p.recompute}{blocks}; sharding " + (f"fsdp over axes {list(p.sharding_axes)}"
                                                    if p.sharding_mode == "fsdp" else "none")


def _ranges(idx: list[int]) -> str:
    out, i = [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ", ".join(out)


def modes_line(plan) -> str:
    """The plan's recomputation and sharding; a pipelined plan's per stage (stage ranges of each mode)."""
    if not plan.stages:
        return _modes(plan)
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(plan.stages):
        groups.setdefault(_modes(s.plan), []).append(i)
    return "; ".join(f"stages {_ranges(idx)} ({len(idx)} of {len(plan.stages)}): {k}" for k, idx in groups.items())


def prepare(argv):
    """(args, model graph, cluster, profile, memory limit and its note, the options of ``autotune.search``) of the
    command line ``argv``: each bad flag refused in one line before the search."""
    args = parser().parse_args(argv)
    budget = parse_budget(args.budget) if args.budget is not None else None
    if not 0 <= args.seed < SEEDS:
        raise UserError(f"--seed {args.seed} is out of range: give a whole number from 0 to {SEEDS - 1}")
    compare = [] if args.compare == "none" else [c.strip() for c in args.compare.split(",") if c.strip()]
    for name in compare:
        if name not in SEARCHES:
            raise UserError(f"unknown search {name!r} in --compare: use some of {', '.join(SEARCHES)}, or none")
    overrides = {k[2:]: v for k, v in vars(args).items() if k.startswith("f_") and v is not None}
    for flag, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if v is not None and v < 1:
            raise UserError(f"{flag} {v} must be at least 1: give the cluster's {flag[2:].replace('-', ' ')}")
    nodes = DEFAULT_NODES if args.nodes is None else args.nodes
    gpus = DEFAULT_GPUS if args.gpus_per_node is None else args.gpus_per_node
    cluster = Cluster(nodes, gpus)
    graph = load_model(args.model, args.preset, overrides, cluster.devices)
    stages = parse_stages(args.pipeline)
    if stages == "off" and args.schedule is not None:
        raise UserError(f"--schedule {args.schedule} orders a pipeline's micro-batches, and --pipeline "
                        f"{args.pipeline} searches none: drop --schedule, or give --pipeline auto or a stage count")
    args.schedule = args.schedule or DEFAULT_SCHEDULE
    if args.virtual_stages is not None and args.schedule != "interleaved-1f1b":
        raise UserError(f"--virtual-stages {args.virtual_stages} sets the chunks a rank of interleaved 1F1B, not of "
                        f"{args.schedule}: add --schedule interleaved-1f1b, or drop --virtual-stages")
    args.virtual_stages = DEFAULT_VIRTUAL if args.virtual_stages is None else args.virtual_stages
    check_pipeline(graph, cluster, stages, args.schedule, args.virtual_stages)
    context = parse_context(args.context_parallel, cluster.devices)
    profile = Profile.load(args.profile)
    if args.memory_limit is not None and not 0 < args.memory_limit <= MAX_MEMORY_GIB:
        raise UserError(f"--memory-limit {args.memory_limit:g} GiB per device is out of range: give a positive "
                        f"number of GiB of at most {MAX_MEMORY_GIB} (a GPU's memory, e.g. 80)")
    allocator = "expandable_segments" if args.expandable_segments else "default"
    limit, limit_note = memory_limit(profile, args.memory_limit, allocator)
    # a config.json's micro-batch left open: the accumulation count is the search's to choose
    counts = accumulation_choices(graph, cluster.devices) if is_hf_file(args.model) and "micro_batch" not in overrides \
        else ()
    options = dict(memory_limit=limit, algorithm=args.search, budget=budget, modes=args.modes, objective=args.objective,
                   seed=args.seed, pipeline=stages, schedule=args.schedule, pipeline_effort=args.pipeline_effort,
                   virtual_stages=args.virtual_stages, context_parallel=context,
                   compare=compare, allocator=allocator, micro_batches=counts)
    return args, graph, cluster, profile, limit_note, options


def parse_context(text: str, devices: int) -> tuple[int, ...] | None:
    """--context-parallel: None for "auto", else its sizes (1: none), each dividing the ``devices``."""
    if text == "auto":
        return None
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(c < 1 for c in sizes):
        raise UserError(f"--context-parallel {text!r} is not 'auto' or sizes: give e.g. 2 or 2,4 (1: none)")
    bad = next((c for c in sizes if devices % c), None)
    if bad is not None:
        raise UserError(f"--context-parallel {bad} does not divide the {devices} devices: give a size that does")
    return sizes


def main(argv=None, report=None) -> int:
    """The search; ``report(staged_plan, plan_path, title)``, given by the command layer, renders the HTML
    report written with plan.json."""
    args, graph, cluster, profile, limit_note, options = prepare(argv)
    limit = options["memory_limit"]
    out = Path(args.out)
    check_utf8(out, "search output directory")
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
        objective, note = choose_objective(args.objective, args.search, profile, cluster.devices)
        if note:
            print(f"note: {note}")
        stale = profile.residuals is not None and current_residuals(profile) is None
        if stale and objective == "step":
            print(f"note: the profile's residuals were fitted against the step model of "
                  f"{profile.residuals.model or 'an unrecorded revision'}, this is {STEP_MODEL}'s: left out "
                  f"(torchrun ... -m autotune tune measures them again)")
        print(f"objective: {OBJECTIVE_WORDS[objective]}", flush=True)
        pf = search(graph, cluster, profile, **dict(options, objective=objective), progress=progress)
        plan, base, skipped = pf.best, pf.baselines, pf.meta.pop("skipped", [])
        pf.meta = {"command": "python -m autotune " + " ".join(argv if argv is not None else sys.argv[1:]),
                   **pf.meta}
        path, rep = out / "plan.json", out / "report.html" if report else None
        text = dumps(pf.to_dict(), "plan file")
        if report:  # the plan and its report written together: both or neither (calibrate.outputs)
            with staged(path, text) as staged_plan:
                html = report(staged_plan, path, plan_title(plan))
            write_together({path: text, rep: html}, "plan and report")
        else:
            write_atomic(path, text, "plan file")
        print(table([plan] + base))
        if plan.stages:
            pl, t, sub = plan.pipeline, plan.costs, plan.submesh
            print(f"pipeline: {len(plan.stages)} stages of {sub.nodes} x {sub.gpus_per_node} GPUs, {pl.schedule}, "
                  f"{plan.micro_batches} micro-batches, blocks per stage {list(pl.split)}; bubble {t.bubble_s:.4g} s, "
                  f"boundaries {t.boundary_s * 1e3:.3g} ms per micro-batch in all")
        if skipped:
            print(f"no plan of {', '.join(skipped)} here: some layer cannot take its placement (e.g. the attention's "
                  f"micro-batch x heads does not cover the {cluster.devices} devices)")
        print(breakdown(plan))
        print("\n".join(summary_lines(plan, base, objective)))
        note = host_note(plan, objective, cluster.devices, profile.name, profile.compute)
        if note:
            print(note)
        print(f"wrote {path}" + (f" and {rep}" if rep else ""))
        own = default_module(args.model)  # a config.json: measured on its transformers class
        print("\n".join(next_steps(path, plan, None if own == DEFAULT_MODULE else own)))
        return 0
