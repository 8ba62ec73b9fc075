"""The stage boundaries of the default pipelined plan, priced as they execute and as the resharding planner
moves them (``autotune.pipeline.boundary``): ``python tests/bench/pipeline_boundaries.py --cases NAME,...``
prints, per distinct boundary of each case's plan (``tests/bench/pipeline_plans.py``'s cases, 80 GiB), the
stream's shape and placements, each route the executor can run (direct; scatter where the stream is a partial
sum) with its sent placement, the route taken, the resharding planner's figure (per micro-batch each way), and
the plan's step and CPU seconds."""
from __future__ import annotations

import time

from calibrate.cli import command_parser
from calibrate.profile import DEFAULT_PROFILE, Profile
from models import load_model

from autotune.pipeline.record import stream
from autotune.pipeline.search import PipelineConfig, PipelineSearch
from autotune.sbp.mesh import Cluster

LIMIT = 80 * 2**30
CASES = {"gpt3-175b@512x8": ("gpt", "gpt3-175b", 512, 8), "gpt3-175b@2048x8": ("gpt", "gpt3-175b", 2048, 8),
         "llama3-405b@512x8": ("llama", "llama3-405b", 512, 8), "llama3-405b@2048x8": ("llama", "llama3-405b", 2048, 8)}


def main() -> None:
    ap = command_parser("python tests/bench/pipeline_boundaries.py", __doc__)
    ap.add_argument("--cases", default="gpt3-175b@512x8", help="cases to run, comma-separated")
    args = ap.parse_args()
    profile = Profile.load(DEFAULT_PROFILE)
    for name in args.cases.split(","):
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}: use one of {', '.join(CASES)}")
        kind, preset, nodes, gpus = CASES[name]
        t0 = time.process_time()
        ps = PipelineSearch(load_model(kind, preset), Cluster(nodes, gpus), profile, LIMIT, PipelineConfig())
        best = ps.run()
        cpu = time.process_time() - t0
        if best is None:
            print(f"{name}: no pipelined plan fits")
            continue
        print(f"{name}: {best.stages} stages of {best.sub}, m {best.micro_batches}, step {best.step:.4g} s "
              f"({cpu:.1f} CPU s)")
        seen = {}
        for i in range(best.stages - 1):
            seen.setdefault(stream(best.plans[i], best.plans[i + 1]), []).append(i)
        for (shape, out, into, grad), where in seen.items():
            f, b = best.boundaries[where[0]]
            taken = ps.pricer.route(shape, out, into, grad, best.sub, best.sub, where[0])
            pf, pb = ps.pricer.planned(shape, out, into, grad, best.sub, best.sub, where[0])
            print(f"  boundaries {where[0]}..{where[-1]} ({len(where)}): {shape} {''.join(out)} -> {''.join(into)} "
                  f"(grad {''.join(grad)}): executed {f * 1e3:.3f} / {b * 1e3:.3f} ms by {taken.name}, planner "
                  f"{pf * 1e3:.3f} / {pb * 1e3:.3f} ms")
            for r in ps.pricer.routes(shape, out, into, grad, best.sub, best.sub, where[0]):
                print(f"    {r.name:8} sent {''.join(r.sent)}: {r.forward * 1e3:.3f} / {r.backward * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
