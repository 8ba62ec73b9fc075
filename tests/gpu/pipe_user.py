"""A pipelined plan applied as a user applies it, for the GPU scripts that look inside its step (pipe_memory.py,
pipe_time.py): PLAN.json's best or the baseline whose name starts with WHICH, on transformers' class of CONFIG.json
(``apply_pipeline``, ``pipe.step`` under bf16 autocast, fused AdamW), one process a GPU under torchrun."""
import os

import torch
import torch.distributed as dist

import autotune
from autotune.execute.usermodule import load_factory
from autotune.plan.file import PlanFile


def setup(plan_path: str, config: str, which: str = ""):
    """(the plan, this rank's ``Pipeline``, its optimizer, its device), the process group made (NCCL; gloo on a
    machine without a GPU, to try the scripts' set-up there)."""
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    pf = PlanFile.load(plan_path)
    plan = next(p for p in [pf.best, *pf.baselines] if p.strategy.startswith(which)) if which else pf.best
    torch.manual_seed(0)
    pipe = autotune.apply_pipeline(plan, load_factory(config)(dict(plan.model.config)))
    return plan, pipe, torch.optim.AdamW(autotune.param_groups(pipe.module), lr=1e-4, fused=gpu), device


def forward_backward(plan, pipe, device, i: int) -> None:
    """The schedule over step ``i``'s batch (random token ids, each rank its piece), under bf16 autocast."""
    m = plan.model.config
    batch = torch.randint(m["vocabulary"], (m["batch"], m["sequence"]), generator=torch.Generator().manual_seed(i))
    piece = autotune.data_piece(pipe.module, batch).to(device)
    with torch.autocast(device.type, torch.bfloat16):
        pipe.step(piece, piece)


def report(lines: list[str]) -> None:
    """Every rank's lines printed by rank 0, then the process group destroyed on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, "\n".join(lines))
    if dist.get_rank() == 0:
        print("\n".join(out), flush=True)
    dist.destroy_process_group()
