"""Pipelined plans executed (issue 30 item 5), measured on CPUs: ``python tests/bench/pipeline_exec.py
[--timeline CASE] [--no-runs]`` prints two tables.

1. The CPU correctness runs: 4 processes (gloo, float64) train the small GPT (reference modules, tied
   embedding and logits) and the small Hugging Face Llama of ``tests/autotune/pipeline_exec_plans.py``
   through ``autotune.apply_pipeline`` with the pipeline search's plans (2 stages x 2 devices, 4 x 1, each
   schedule) for two Adam steps; per run the largest relative difference of the losses and the largest
   absolute difference of any parameter entry (weights are O(0.02)-O(1)) from the same model trained in
   one process, the micro-batches each rank kept in flight in the last step beside the plan's, and the
   wall seconds of the 4-process launch.
2. One plan's per-stage timeline as the step model predicts it (the plan's ``stages[i].timeline``): per
   stage its blocks, forward and backward per micro-batch, the boundary to the next stage, the
   micro-batches in flight, the end of its last backward and its idle share of the step; then the
   timeline drawn in characters (F forward, B backward, one column per ``step / width`` seconds).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401  (imported once, before the workers fork)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "autotune"))
from gloo_runner import run_on_gloo  # noqa: E402
from pipeline_exec_plans import GPT, LLAMA, searched, train_one_process  # noqa: E402
from test_pipeline_exec import train_pipelined  # noqa: E402

from calibrate.cli import command_parser  # noqa: E402
from calibrate.profile import DEFAULT_PROFILE, Profile  # noqa: E402
from models import load_model  # noqa: E402

from autotune.pipeline.record import pipeline_plans  # noqa: E402
from autotune.pipeline.search import PipelineConfig  # noqa: E402
from autotune.sbp.mesh import Cluster  # noqa: E402

RUNS = [("gpt", 2, "1f1b"), ("llama", 2, "1f1b"), ("gpt", 4, "1f1b"), ("llama", 4, "1f1b"), ("gpt", 4, "gpipe"),
        ("llama", 4, "eager-1f1b")]
TIMELINES = {"gpt3-1.3b@2x8": ("gpt", "gpt3-1.3b", 2, 8, 4), "gpt3-175b@512x8": ("gpt", "gpt3-175b", 512, 8, None)}


def _rel(a, b) -> float:
    return float(((a - b).abs() / b.abs()).max())


def correctness() -> None:
    print("| model | stages x devices | schedule | micro-batches | split | max rel. loss diff | "
          "max abs. parameter diff | in flight per rank, run (plan) | wall s (4 processes) |")
    print("| --- | --- | --- | ---: | --- | ---: | ---: | --- | ---: |")
    for kind, stages, schedule in RUNS:
        cfg = dict(GPT if kind == "gpt" else LLAMA, batch=32 if stages == 2 else 8)
        plan = searched(cfg, stages, schedule=schedule)
        t0 = time.perf_counter()
        got = [ranks[0] for ranks in run_on_gloo(train_pipelined, [(cfg, plan)])]
        wall = time.perf_counter() - t0
        assert not any(isinstance(g, str) for g in got), got  # a rank's failure
        ref_losses, ref_params = train_one_process(cfg, plan.micro_batches)
        loss = max(_rel(torch.tensor(g[0]), torch.tensor(ref_losses)) for g in got)
        par = max(float((p - ref_params[n]).abs().max()) for g in got for n, p in g[1].items())
        run = [g[2] for g in got]
        want = [s.inflight for s in plan.stages for _ in range(4 // stages)]
        print(f"| {kind} | {stages} x {4 // stages} | {schedule} | {plan.micro_batches} | "
              f"{list(plan.pipeline.split)} | {loss:.1e} | {par:.1e} | {run} ({want}) | {wall:.1f} |")


def timeline(case: str, width: int) -> None:
    kind, preset, nodes, gpus, stages = TIMELINES[case]
    graph = load_model(kind, preset, {})
    t0 = time.process_time()
    plan, _ = pipeline_plans(graph, Cluster(nodes, gpus), Profile.load(DEFAULT_PROFILE), 80 * 2**30,
                             PipelineConfig(stages if stages is not None else "auto", "1f1b"))
    cpu = time.process_time() - t0
    t, sub = plan.costs, plan.submesh
    print(f"\n{case}: {plan.strategy}, {len(plan.stages)} stages of {sub.nodes} x {sub.gpus_per_node}, "
          f"step {t.step_s:.4g} s, bubble {t.bubble_s:.4g} s (search {cpu:.1f} CPU s, {DEFAULT_PROFILE})")
    print("| stage | blocks | forward ms / mb | backward ms / mb | boundary fwd / bwd ms | in flight | "
          "last backward ends s | idle share of the step |")
    print("| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    step = t.step_s
    for i, s in enumerate(plan.stages):
        busy = sum(end - start for what, _, start, end in s.timeline if what in ("F", "B"))
        print(f"| {i} | {s.blocks} | {s.forward_s * 1e3:.3f} | {s.backward_s * 1e3:.3f} | "
              f"{s.boundary_forward_s * 1e3:.3f} / {s.boundary_backward_s * 1e3:.3f} | {s.inflight} | "
              f"{s.end_s:.4g} | {1 - busy / step:.1%} |")
    if len(plan.stages) > 16:
        return
    print(f"\ntimeline ({width} columns of {step / width * 1e3:.3g} ms; F forward, B backward, . idle)")
    for i, s in enumerate(plan.stages):
        row = ["."] * width
        for what, _, start, end in s.timeline:
            if what not in ("F", "B"):
                continue
            for col in range(int(start / step * width), max(int(start / step * width) + 1,
                                                               int(end / step * width))):
                row[min(col, width - 1)] = what
        print(f"stage {i:>2} {''.join(row)}")


def main() -> None:
    ap = command_parser("python tests/bench/pipeline_exec.py", __doc__)
    ap.add_argument("--timeline", default="gpt3-1.3b@2x8", choices=list(TIMELINES),
                    help="the plan whose per-stage timeline to print")
    ap.add_argument("--width", type=int, default=100, help="columns of the drawn timeline")
    ap.add_argument("--no-runs", action="store_true", help="skip the 4-process correctness runs")
    args = ap.parse_args()
    if not args.no_runs:
        correctness()
    timeline(args.timeline, args.width)


if __name__ == "__main__":
    main()
