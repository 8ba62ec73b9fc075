"""The plans of the GPU check of ``python -m autotune execute`` (tests/gpu/execute_check.sh):
the searched plans (one per objective, from ``python -m autotune --out DIR`` runs given
as --searched), then data parallelism, Megatron on every mesh and SUMMA, then --random
plans spread over the range of predicted step time, into one plan.json whose best is
the first searched plan.

Why spread: the ranking target (Spearman over the plans) needs plans whose step times
differ by more than the run-to-run noise (about 1%); plans drawn at random cluster
(six of the first run's 11 plans lay within 4% of each other, where the noise decided
their order). So --pool random plans that fit the memory limit are drawn, sorted by
predicted step time, and --random of them are taken at evenly spaced ranks, the
fastest and the slowest included. The choice uses predictions only, never measurements.

    python tests/gpu/execute_plans.py OUT.json --searched step=DIR comm=DIR --random 10 \
        --profile P.json --nodes 1 --gpus-per-node 2 --hidden 4096 ...
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import numpy as np

from calibrate.cli import run_cli
from calibrate.profile import Profile
from models import load_model

from autotune.sbp.baselines import best_mesh, data_parallel, megatron_assignment, summa_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster, role_meshes
from autotune.plan.build import build as build_plan
from autotune.plan.file import PlanFile

def key(plan) -> str:
    """What a plan does: the signature and placements of every layer."""
    return json.dumps([(lay.signature, lay.input, lay.output, [w.placements for w in lay.weights])
                       for lay in plan.layers])


FIELDS = ("layers", "hidden", "heads", "sequence", "vocabulary", "batch", "micro_batch", "ffn")


def spread(plans: list, n: int) -> list:
    """``n`` of ``plans`` at evenly spaced ranks of predicted step time (communication without a step model)."""
    if n <= 0 or not plans:
        return []
    measure = "step" if plans[0].costs.step_s is not None else "comm"
    ranked = sorted(plans, key=lambda p: p.costs.of(measure))
    if n >= len(ranked):
        return ranked
    picks = sorted({round(i * (len(ranked) - 1) / (n - 1)) for i in range(n)}) if n > 1 else [0]
    return [ranked[i] for i in picks]


def named_plans(problem) -> list:
    """Data parallelism, Megatron on every 2-role mesh and SUMMA on its best mesh."""
    out = [build_plan(problem, data_parallel(problem), "data parallel")]
    for m in role_meshes(problem.cluster, 2):
        a = megatron_assignment(problem, *m.sizes)
        if a is not None:
            out.append(build_plan(problem, a, f"Megatron d={m.sizes[0]} t={m.sizes[1]}"))
    sp = Problem(problem.graph, problem.coster, problem.memory_limit, signatures=("summa",), objective=problem.objective)
    a, _, mesh = best_mesh(sp, summa_assignment)
    if a is not None:
        out.append(build_plan(sp, a, f"SUMMA {mesh}"))
    return out


def random_plans(problem, pool: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out, seen = [], set()
    for _ in range(20 * pool):
        if len(out) >= pool:
            break
        a = problem.random_assignment(rng)
        if tuple(a) in seen or not problem.feasible(a):
            continue
        seen.add(tuple(a))
        out.append(build_plan(problem, a, "random"))
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--searched", nargs="*", default=[], help="LABEL=DIR of python -m autotune runs")
    ap.add_argument("--random", type=int, default=10, help="random plans, spread over predicted step time")
    ap.add_argument("--pool", type=int, default=300, help="random plans drawn to choose them from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--memory-limit", type=float, default=None, help="GiB per device")
    for f in FIELDS:
        ap.add_argument("--" + f.replace("_", "-"), dest=f, type=int, default=None)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    graph = load_model("gpt", None, {f: getattr(args, f) for f in FIELDS})
    limit = args.memory_limit * 2**30 if args.memory_limit else None
    problem = Problem(graph, Coster(Profile.load(args.profile), Cluster(args.nodes, args.gpus_per_node)), limit,
                      objective="step" if Profile.load(args.profile).compute is not None else "comm")
    plans, seen = [], set()
    for item in args.searched:
        label, _, folder = item.partition("=")
        best = replace(PlanFile.load(f"{folder}/plan.json").best, strategy=f"searched ({label} objective)")
        plans.append(best)
        seen.add(key(best))
    for p in named_plans(problem):
        if key(p) not in seen:
            seen.add(key(p))
            plans.append(p)
    pool = [p for p in random_plans(problem, args.pool, args.seed) if key(p) not in seen]
    for i, p in enumerate(spread(pool, args.random)):
        plans.append(replace(p, strategy=f"random #{i + 1}"))
    path = PlanFile(plans[0], plans[1:], {}, {"command": "tests/gpu/execute_plans.py " + " ".join(sys.argv[1:])}).save(args.out)
    print(f"wrote {len(plans)} plans to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="execute_plans"))
