"""Each pipeline stage's peak memory, by where it was allocated: a pipelined plan (PLAN.json's best or the baseline
whose name starts with WHICH) applied to transformers' class of CONFIG.json as a user would (``apply_pipeline``,
``pipe.step``), one step under the allocator's history on every rank after WARMUP steps (``alloc_trace``).

    torchrun --nproc-per-node 2 tests/gpu/pipe_memory.py PLAN.json CONFIG.json [WHICH] > out.txt

Prints, per rank: its stage, the plan's predicted peak and its parts, the peak measured by the history and by
``max_memory_allocated``, and the sites alive at the peak, largest first."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alloc_trace import site, traced_step  # noqa: E402
from pipe_user import forward_backward, report, setup  # noqa: E402

GIB = 2 ** 30


def main(plan_path: str, config: str, which: str = "") -> None:
    plan, pipe, opt, device = setup(plan_path, config, which)

    def step(i: int = 0) -> None:
        forward_backward(plan, pipe, device, i)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(int(os.environ.get("WARMUP", "2"))):
        step(i)
    torch.cuda.reset_peak_memory_stats(device)
    before, peak, at, sites = traced_step(torch, step, site)
    s = plan.stages[pipe.stage]
    parts = {k: round(v / GIB, 2) for k, v in s.plan.costs.memory.items()}
    lines = [f"rank {dist.get_rank()} stage {pipe.stage} ({s.blocks} blocks, {s.inflight} in flight): predicted "
             f"{s.memory_bytes / GIB:.2f} GiB {parts}; history peak {peak / GIB:.2f} GiB (alive before the step "
             f"{before / GIB:.2f}), max_memory_allocated {torch.cuda.max_memory_allocated(device) / GIB:.2f}; "
             f"reached at {at}"]
    lines += [f"  {b / GIB:7.2f} GiB {n:5d} tensors  {w}" for w, (b, n) in
              sorted(sites.items(), key=lambda kv: -kv[1][0])[:14]]
    report(lines)


if __name__ == "__main__":
    main(*sys.argv[1:])
