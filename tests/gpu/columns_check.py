"""FSDP with the embedding split by columns (``autotune.plan.layouts.column_twin``) on the GPUs under NCCL: the tiny
transformers Llama of the gloo tests (float64), two Adam steps of two micro-batches on each rank's piece of the
batch, placed by ``autotune.apply`` on the fully_shard path, against the same model in one process on rank 0's
GPU (gloo on the CPU where none is visible); prints the path, both runs' losses and the largest parameter difference.

    torchrun --nproc-per-node 2 tests/gpu/columns_check.py"""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "autotune"))
from apply_plans import LLAMA, data_parallel, typed_plan  # noqa: E402
from tiny_models import hf_llama  # noqa: E402

import autotune  # noqa: E402


def train(model, plan, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA["vocabulary"], (LLAMA["batch"], LLAMA["sequence"] + 1), generator=g).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        piece = autotune.data_piece(model, ids) if dist.is_initialized() else ids
        mbs = autotune.micro_batches(plan, piece)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for mb in autotune.accumulate(model, mbs):
            logits = model(input_ids=mb[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb[:, 1:].reshape(-1))
            (loss / len(mbs)).backward()
            total += loss.detach() / len(mbs)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def main():
    rank, gpu = int(os.environ["RANK"]), torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"  # gloo on a machine without GPUs: the same check
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    world = dist.get_world_size()
    placements = data_parallel(LLAMA, axes=1)
    placements["embedding"] = (None, ("S1",), {"weight": ("S1",)})
    plan = typed_plan(LLAMA, 1, world, placements, "FSDP, the embedding by columns", fsdp_axes=(0,))
    model = autotune.apply(plan, hf_llama(LLAMA, 0))
    losses = train(model, plan, device)
    for t in losses:
        dist.all_reduce(t)
    got = [float(t) / world for t in losses]
    from torch.distributed.tensor import DTensor
    params = {n.replace("_fsdp_wrapped_module.", ""): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
              for n, p in model.named_parameters()}
    if rank == 0:
        ref_model = hf_llama(LLAMA, 0).to(device)
        ref = [float(t) for t in train(ref_model, plan, device)]
        diff = max((params[n] - p.detach()).abs().max().item() for n, p in ref_model.named_parameters())
        print(f"path {model._autotune_path}; losses {got} against one process {ref}; largest parameter difference "
              f"{diff:.3g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
