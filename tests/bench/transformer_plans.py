"""Searched transformer plans against the baselines users pick: ``python tests/bench/transformer_plans.py``
prints a markdown table.

Per preset and cluster size: the default command's search (``python -m autotune``: the modes driver over
recomputation and FSDP, the default profile and its memory limit, the step objective) and its predicted
step time, beside FSDP, HSDP, TP+FSDP and Megatron, each at its best recomputation
(``autotune.sbp.baselines``); a baseline with no plan that fits shows the memory it needs. CPU seconds of
this process. Run it from the checkout with ``PYTHONPATH=.``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from calibrate.profile import DEFAULT_PROFILE, Profile
from models import load_model

from autotune.sbp.baselines import baseline_plans, best_mesh, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.cli.search import memory_limit
from autotune.sbp.cost import Problem
from autotune.sbp.fit import scaled, search_modes
from autotune.sbp.mesh import Cluster
from autotune.plan.build import build as build_plan
from autotune.sbp.search import auto_budget, make_search

# (model, preset, nodes, gpus per node, field overrides). A graph's micro-batch is global (the sequences of
# one micro-batch over all devices): torchtitan's Llama 3 configs run no gradient accumulation, so the
# micro-batch is the whole batch (the presets' micro_batch is torchtitan's local batch); at 2,048 nodes the
# Llama 3 paper's batch of 16M tokens (2,048 sequences of 8,192), as 32 sequences cannot cover 16,384 GPUs
CASES = [
    ("llama", "llama3-8b", 8, 8, {"micro_batch": 64}),
    ("llama", "llama3-70b", 8, 8, {"micro_batch": 64}),
    ("llama", "llama3-405b", 16, 8, {"micro_batch": 32}),
    ("llama", "llama3-405b", 2048, 8, {"batch": 2048, "micro_batch": 2048}),
    ("gpt", "gpt3-175b", 512, 8, {}),
]
BASELINES = ("FSDP", "HSDP", "TP+FSDP", "Megatron")


def run(pr: Problem, start, share=1.0):
    return make_search("cd").run(pr, scaled(auto_budget(pr), share), np.random.default_rng(0), start)


def row(model: str, preset: str, nodes: int, gpus: int, overrides: dict, profile: str) -> dict:
    t0 = time.process_time()
    prof = Profile.load(profile)
    limit, _ = memory_limit(prof, None)
    objective = "step" if prof.compute is not None else "comm"
    plain = Problem(load_model(model, preset, overrides), Coster(prof, Cluster(nodes, gpus)), limit, objective=objective,
                    require_fit=False)
    mega, mega_cost, _ = best_mesh(plain, megatron_assignment)
    warm = mega if mega is not None and np.isfinite(mega_cost) else None
    pr, res = search_modes(plain, run, warm)
    search_s = time.process_time() - t0
    plan = build_plan(pr, res.assignment, "searched") if res is not None else None
    base = {}
    for b in (build_plan(*found) for found in baseline_plans(plain, None, None, None)):
        for name in BASELINES:
            if b.strategy.startswith(name + " ") or b.strategy == name:
                base[name] = b
    fields = ", ".join(f"{k} {v}" for k, v in overrides.items())
    return {"case": f"{preset} {nodes}x{gpus}" + (f" ({fields})" if fields else ""), "limit": limit, "plan": plan, "search_s": search_s, "base": base}


def cell(p) -> str:
    if p is None:
        return "no plan"
    t, rec = p.costs, p.recompute
    tag = "" if rec == "none" else f", recompute {rec}"
    if not t.fits_memory:
        return f"does not fit ({t.memory_bytes / 2**30:.0f} GiB{tag})"
    return f"{t.step_s:.4g}{tag}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/bench/transformer_plans.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", type=int, action="append", help="run only case N (0-based; repeatable)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    args = ap.parse_args(argv)
    cases = [CASES[i] for i in args.case] if args.case else CASES
    print("| case | memory limit GiB | searched s/step (mode) | " + " | ".join(f"{b} s/step" for b in BASELINES)
          + " | speed-up over the best baseline | search CPU s |")
    print("| --- | ---: | --- | " + " | ".join("---" for _ in BASELINES) + " | ---: | ---: |")
    for c in cases:
        r = row(*c, args.profile)
        p = r["plan"]
        if p is not None:
            mode = f"recompute {p.recompute}, " + ("FSDP" if p.sharding_mode == "fsdp" else "no FSDP")
            searched = f"{p.costs.step_s:.4g} ({mode})" + ("" if p.costs.fits_memory else ", does not fit")
        else:
            searched = "no plan fits"
        fit = [b.costs.step_s for b in r["base"].values() if b.costs.fits_memory]
        speed = f"{min(fit) / p.costs.step_s:.2f}x" if fit and p is not None else "-"
        print(f"| {r['case']} | {r['limit'] / 2**30:.1f} | {searched} | "
              + " | ".join(cell(r["base"].get(b)) for b in BASELINES) + f" | {speed} | {r['search_s']:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
