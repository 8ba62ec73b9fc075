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

import autotune  # noqa: E402
from autotune.execute.usermodule import load_factory  # noqa: E402
from autotune.plan.file import PlanFile  # noqa: E402

GIB = 2 ** 30
def main(plan_path: str, config: str, which: str = "") -> None:
    dist.init_process_group("nccl")
    rank, device = dist.get_rank(), torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    pf = PlanFile.load(plan_path)
    plan = next(p for p in [pf.best, *pf.baselines] if p.strategy.startswith(which)) if which else pf.best
    m = plan.model.config
    torch.manual_seed(0)
    pipe = autotune.apply_pipeline(plan, load_factory(config)(dict(m)))
    opt = torch.optim.AdamW(autotune.param_groups(pipe.module), lr=1e-4, fused=True)

    def step(i: int = 0) -> None:
        batch = torch.randint(m["vocabulary"], (m["batch"], m["sequence"]), generator=torch.Generator().manual_seed(i))
        piece = autotune.data_piece(pipe.module, batch).to(device)
        with torch.autocast("cuda", torch.bfloat16):
            pipe.step(piece, piece)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(int(os.environ.get("WARMUP", "2"))):
        step(i)
    torch.cuda.reset_peak_memory_stats(device)
    before, peak, at, sites = traced_step(torch, step, site)
    stage = next(i for i, s in enumerate(plan.stages) if rank in range(
        sum(st.plan.cluster.devices for st in plan.stages[:i]), sum(st.plan.cluster.devices for st in plan.stages[:i + 1])))
    s = plan.stages[stage]
    parts = {k: round(v / GIB, 2) for k, v in s.plan.costs.memory.items()}
    lines = [f"rank {rank} stage {stage} ({s.blocks} blocks, {s.inflight} in flight): predicted {s.memory_bytes / GIB:.2f} "
             f"GiB {parts}; history peak {peak / GIB:.2f} GiB (alive before the step {before / GIB:.2f}), "
             f"max_memory_allocated {torch.cuda.max_memory_allocated(device) / GIB:.2f}; reached at {at}"]
    lines += [f"  {b / GIB:7.2f} GiB {n:5d} tensors  {w}" for w, (b, n) in
              sorted(sites.items(), key=lambda kv: -kv[1][0])[:14]]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, "\n".join(lines))
    if rank == 0:
        print("\n".join(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
