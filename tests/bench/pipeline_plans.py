"""Pipeline stages in the main search, measured (a benchmark; issue 30 item 7):
``python tests/bench/pipeline_plans.py [--cases NAME,...] [--no-reference] [--no-single]`` prints a table.

Per case (model preset on nodes x GPUs, the default profile, 80 GiB unless ``--memory-limit`` (GiB, or
``profile``: the profile's usable memory, the default command's limit), 1F1B): the pipelined plan of the
default search (its stages, micro-batches, split, step) and its CPU seconds on this process (one core);
the same search with 20x the effort (``PipelineConfig.reference``: wider splits, more micro-batch
counts, larger stages, more candidates refined, 20x each stage's SBP budget) and the default's gap to
it (``--reference space``: the wider space on the default budgets; ``--reference budget``: 20x each stage's
SBP budget on the default space; ``full``, the default: both); the best Megatron-style 3-D plan
(``autotune.pipeline.threed``: degrees, micro-batches, recomputation and FSDP searched) and its CPU seconds;
``--split-dps N``: the split DP for the N fastest balanced candidates (default 1; ``refine``, 2, is the
earlier default's coverage); ``--patience N|none`` / ``--relax-rounds N``: the default search with each stage
search's restart patience capped at N / N bisection steps per relaxation multiplier (``PipelineConfig``; the
reference keeps its full effort);
the faster of the two, the plan record's pipelined plan (``threed.seeded``); and, unless --no-single, the single-stage plan of today's search (``python -m autotune``'s, started from the
best Megatron plan) and the pipelined plan's speed-up over it.
"""
from __future__ import annotations

import time
from argparse import ArgumentTypeError
from dataclasses import replace

import numpy as np

from calibrate.cli import command_parser
from calibrate.errors import UserError
from calibrate.profile import DEFAULT_PROFILE, Profile
from models import load_model

from autotune.pipeline.search import PipelineConfig, PipelineSearch
from autotune.pipeline.threed import megatron_3d
from autotune.sbp.baselines import best_mesh, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.cli.search import memory_limit
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.sbp.search import auto_budget, make_search

LIMIT = 80 * 2**30
CASES = {"gpt3-175b@512x8": ("gpt", "gpt3-175b", 512, 8), "gpt3-175b@2048x8": ("gpt", "gpt3-175b", 2048, 8),
         "llama3-405b@512x8": ("llama", "llama3-405b", 512, 8), "llama3-405b@2048x8": ("llama", "llama3-405b", 2048, 8)}


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return n


def patience(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return positive(text)
    except ArgumentTypeError:
        raise ArgumentTypeError(f"{text!r}: give a whole number of at least 1, or none") from None


def single_stage(graph, cluster, profile, limit) -> float:
    problem = Problem(graph, Coster(profile, cluster), limit, objective="step", require_fit=False)
    if not problem.fits:
        return float("inf")
    mega, cost, _ = best_mesh(problem, megatron_assignment)
    start = mega if mega is not None and np.isfinite(cost) else None
    return make_search("cd").run(problem, auto_budget(problem), np.random.default_rng(0), start).cost


def run(graph, cluster, profile, cfg, limit):
    c0 = time.process_time()
    ps = PipelineSearch(graph, cluster, profile, limit, cfg)
    best = ps.run()
    return best, time.process_time() - c0, ps


def describe(c) -> str:
    return f"{c.stages} x {c.sub.nodes}x{c.sub.gpus_per_node}, m {c.micro_batches}" if c is not None else "none"


def _modes(c) -> str:
    """The 3-D plan's recomputation / FSDP, as its name gives them."""
    return "".join(f", {x.strip(')')}" for x in c.name.split(", ") if x.startswith(("recompute", "FSDP")))


def main() -> None:
    ap = command_parser("python tests/bench/pipeline_plans.py", __doc__)
    ap.add_argument("--cases", default=",".join(CASES), help="cases to run, comma-separated")
    ap.add_argument("--no-reference", action="store_true", help="skip the 20x reference search")
    ap.add_argument("--reference", choices=("full", "space", "budget"), default="full",
                    help="the reference: the wider space and 20x budgets (full), or either alone")
    ap.add_argument("--memory-limit", default=str(LIMIT / 2**30),
                    help="GiB per device, or 'profile' (the profile's usable memory); default 80")
    ap.add_argument("--split-dps", type=positive, default=PipelineConfig.split_dps,
                    help=f"candidates the split DP refines in the default search (default {PipelineConfig.split_dps})")
    ap.add_argument("--patience", type=patience, default=PipelineConfig.patience,
                    help=f"cap on each stage search's restart patience in the default search (default "
                         f"{PipelineConfig.patience}; none: auto_budget's)")
    ap.add_argument("--relax-rounds", type=positive, default=PipelineConfig.relax_rounds,
                    help=f"relaxation bisection steps per multiplier in the default search "
                         f"(default {PipelineConfig.relax_rounds})")
    ap.add_argument("--no-single", action="store_true", help="skip today's single-stage search")
    args = ap.parse_args()
    profile = Profile.load(DEFAULT_PROFILE)
    try:
        limit = memory_limit(profile, None)[0] if args.memory_limit == "profile" else float(args.memory_limit) * 2**30
    except ValueError:
        raise SystemExit(f"--memory-limit {args.memory_limit!r}: give GiB per device or 'profile'") from None
    rows = [("case", "pipelined", "step s", "CPU s", "20x step s", "gap %", "Megatron 3-D", "3-D step s", "3-D CPU s",
             "single-stage s", "speed-up")]
    for name in args.cases.split(","):
        kind, preset, nodes, gpus = CASES[name]
        try:
            graph = load_model(kind, preset)
        except UserError:  # the llama kind is not in this tree yet
            rows.append((name, f"no {kind} preset {preset}", *["-"] * 9))
            continue
        cluster = Cluster(nodes, gpus)
        default = PipelineConfig(loss_room=True, patience=args.patience, relax_rounds=args.relax_rounds,
                                 split_dps=args.split_dps)
        best, cpu, ps = run(graph, cluster, profile, default, limit)
        print(f"{name}: default {describe(best)} split {best.split if best else '-'}: "
              f"{best.step if best else float('inf'):.4g} s/step, {cpu:.1f} CPU s, {ps.stages.searches} stage searches",
              flush=True)
        c0 = time.process_time()
        mega = megatron_3d(ps)
        mega_cpu = time.process_time() - c0
        print(f"{name}: {mega.name if mega else 'Megatron 3-D: none fits'}: {mega.step if mega else float('inf'):.4g} "
              f"s/step, {mega_cpu:.1f} CPU s", flush=True)
        seed = min((c for c in (best, mega) if c is not None), key=lambda c: c.step, default=None)
        if seed is not None:  # threed.seeded's choice, without searching again
            print(f"{name}: the plan record's pipelined plan (threed.seeded): {describe(seed)}: {seed.step:.4g} "
                  f"s/step", flush=True)
        full = PipelineConfig(loss_room=True).reference()
        cfg = {"full": full, "space": replace(full, budget_scale=PipelineConfig.budget_scale),
               "budget": replace(PipelineConfig(loss_room=True), budget_scale=full.budget_scale)}[args.reference]
        ref, ref_cpu, _ = (None, 0.0, None) if args.no_reference else run(graph, cluster, profile, cfg, limit)
        if ref is not None:
            print(f"{name}: reference ({args.reference}) {describe(ref)} split {ref.split}: {ref.step:.4g} s/step, "
                  f"{ref_cpu:.1f} CPU s", flush=True)
        single = None if args.no_single else single_stage(graph, cluster, profile, limit)
        step = best.step if best is not None else float("inf")
        rows.append((name, describe(best), f"{step:.4g}", f"{cpu:.1f}",
                     f"{ref.step:.4g}" if ref is not None else "-",
                     f"{(step / ref.step - 1) * 100:+.2f}" if ref is not None else "-",
                     f"t={mega.tensor}, {describe(mega)}{_modes(mega)}" if mega is not None else "none",
                     f"{mega.step:.4g}" if mega is not None else "-", f"{mega_cpu:.1f}",
                     f"{single:.4g}" if single is not None else "-",
                     f"{single / step:.2f}x" if single is not None else "-"))
        print(" | ".join(rows[-1]), flush=True)
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n".join("  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows))


if __name__ == "__main__":
    main()
