"""The plans of the GPU check of ``python -m autotune execute`` (tests/gpu/execute_check.sh):
the searched plans (one per objective, from ``python -m autotune --out DIR`` runs given
as --searched), then data parallelism, Megatron and SUMMA on every mesh, the S/B-only
search and random plans (autotune.sbp.validate.candidate_plans: distinct predictions),
into one plan.json whose best is the first searched plan.

    python tests/gpu/execute_plans.py OUT.json --searched step=DIR comm=DIR --plans 10 \
        --profile P.json --nodes 1 --gpus-per-node 2 --hidden 4096 ...
"""
from __future__ import annotations

import argparse
import json
import sys

from calibrate.cli import run_cli
from calibrate.profile import Profile
from models import load_model

from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.sbp.plan import PlanFile
from autotune.sbp.validate import candidate_plans

def key(plan: dict) -> str:
    """What a plan does: the signature and placements of every layer."""
    return json.dumps([(lay["signature"], lay["sbp"]) for lay in plan["layers"]], sort_keys=True)


FIELDS = ("layers", "hidden", "heads", "sequence", "vocabulary", "batch", "micro_batch", "ffn")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--searched", nargs="*", default=[], help="LABEL=DIR of python -m autotune runs")
    ap.add_argument("--plans", type=int, default=10)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--memory-limit", type=float, default=None, help="GiB per device")
    for f in FIELDS:
        ap.add_argument("--" + f.replace("_", "-"), dest=f, type=int, default=None)
    args = ap.parse_args(argv)
    graph = load_model("gpt", None, {f: getattr(args, f) for f in FIELDS})
    limit = args.memory_limit * 2**30 if args.memory_limit else None
    problem = Problem(graph, Coster(Profile.load(args.profile), Cluster(args.nodes, args.gpus_per_node)), limit)
    plans, seen = [], set()
    for item in args.searched:
        label, _, folder = item.partition("=")
        best = PlanFile.load(f"{folder}/plan.json").best
        best["strategy"] = f"searched ({label} objective)"
        plans.append(best)
        seen.add(key(best))
    for p in candidate_plans(problem, args.plans + len(plans), 0):
        if len(plans) >= args.plans + len(args.searched):
            break
        if key(p) not in seen and not p["strategy"].startswith("searched"):
            seen.add(key(p))
            plans.append(p)
    path = PlanFile(plans[0], plans[1:], {}, {"command": "tests/gpu/execute_plans.py " + " ".join(sys.argv[1:])}).save(args.out)
    print(f"wrote {len(plans)} plans to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="execute_plans"))
