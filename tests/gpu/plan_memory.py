"""A single-stage plan's memory by where it was allocated, out-of-memory runs included: PLAN.json's best or the
candidate whose name starts with WHICH, run as ``autotune tune`` runs it (execute's runner: ``autotune.apply``,
``ModuleTrainer``, transformers' class of CONFIG.json) under the allocator's recorded history from the model's
build on; at the run's end, or at its out-of-memory error, the sites alive at the history's peak (``alloc_trace``).

    torchrun --nproc-per-node 2 tests/gpu/plan_memory.py PLAN.json CONFIG.json [WHICH] > out.txt

Prints (rank 0): the plan's predicted peak and its parts, the error (the size asked, what was allocated and what was
reserved but unallocated: the caching allocator's fragmentation), the history's peak, and the sites alive then."""
import os
import sys

import torch
import torch.distributed as dist

from alloc_trace import peak_live, site
from autotune.execute import runner
from autotune.execute.env import start, stop
from autotune.plan.file import PlanFile


def main(plan_path: str, config: str, which: str = "best") -> None:
    d = start("cuda")
    pf = PlanFile.load(plan_path)
    plan = pf.best if which == "best" else next(p for p in pf.baselines if p.strategy.startswith(which))
    torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
    error = None
    try:
        runner.run_module_plan(plan, d, module=config, steps=2, warmup=1, profile_steps=0)
    except torch.cuda.OutOfMemoryError as e:
        error = str(e).splitlines()[0][:400]
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, at, sites = peak_live(snap, torch.cuda.current_device(), site)
    if dist.get_rank() == 0:
        print(f"{plan.strategy} [{plan.apply_path}]: predicted {plan.costs.memory_bytes / 2**30:.2f} GiB "
              + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in plan.costs.memory.items()))
        print(f"error: {error}")
        print(f"history peak {peak / 2**30:.2f} GiB (reached at {at}); max allocated "
              f"{torch.cuda.max_memory_allocated() / 2**30:.2f}, max reserved "
              f"{torch.cuda.max_memory_reserved() / 2**30:.2f}")
        for where, (nbytes, n) in sorted(sites.items(), key=lambda x: -x[1][0])[:25]:
            print(f"  {nbytes / 2**30:8.2f} GiB {n:6d}  {where}")
    sys.stdout.flush()
    if error is None:
        stop(d)  # the communicators destroyed on every rank
    else:
        os._exit(0)  # a rank that ran out may have left its peer in a collective: no orderly teardown to wait on


if __name__ == "__main__":
    main(*sys.argv[1:])
