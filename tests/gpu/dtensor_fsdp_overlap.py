"""Whether the DTensor path's FSDP (``autotune.apply.dtensor``: each weight stored split, all-gathered at use by a
parametrization whose backward reduce-scatters) hides its collectives behind the compute as fully_shard's prefetch
does, or runs them in series with it (issue 42: per-layer plans with FSDP on the DTensor path ran 1-4% slower than
fully_shard's on 2 x H200, priced 0.1-0.8% faster).

    torchrun --nproc-per-node 2 tests/gpu/dtensor_fsdp_overlap.py [LAYERS [WIDTH [TOKENS [RECOMPUTE]]]]   # 16 4096 32768 0

A stack of LAYERS square Linear layers (fp32 weights, bf16 autocast, no bias), each rank TOKENS rows of its own,
forward and backward (no optimizer), medians of 7 rounds after 3, per arm:

- ``local``: the weights whole on every rank, no collective (the compute alone);
- ``dtensor``: the DTensor path's FSDP (the weights stored Shard(0), ``_Gather`` at use, the input Shard(0));
- ``fully_shard``: FSDP2 on each layer and the stack (torchtitan's composition, implicit forward prefetch);
- ``collectives``: each layer's all-gather (forward), and reduce-scatter (backward) of its fp32 weight alone,
  in the order the ``dtensor`` arm issues them (the backward's weights are the forward's casts, saved);
  with RECOMPUTE 1, each layer under ``torch.utils.checkpoint`` in every arm, and the gathers again in the
  backward's re-run.

A path whose collectives run in series with the compute costs ``local`` + ``collectives``; one that hides them,
``local`` plus what running beside them costs the compute."""
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch import nn

ROUNDS, WARMUP = 7, 3


def timed(fn) -> float:
    """Median milliseconds of ``fn`` over ROUNDS after WARMUP, CUDA events, ranks aligned before each."""
    out = []
    for i in range(WARMUP + ROUNDS):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            out.append(a.elapsed_time(b))
    return statistics.median(out)


class Rerun(nn.Module):
    """``inner`` re-run in the backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, x, use_reentrant=False)


def stack(layers: int, width: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers))).cuda()


def wrapped(m: nn.Sequential, recompute: bool) -> nn.Module:
    return nn.Sequential(*(Rerun(lin) for lin in m)) if recompute else m


def step(model, x) -> None:
    with torch.autocast("cuda", torch.bfloat16):
        y = model(x)
    y = y.to_local() if hasattr(y, "to_local") else y
    y.float().square().mean().backward()
    model.zero_grad(set_to_none=True)


def main(layers: int, width: int, tokens: int, recompute: int = 0) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.nn.utils import parametrize

    from autotune.apply.dtensor import _Gather

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    x = torch.randn(tokens, width, device="cuda")
    rows = {}

    def show(arm, ms):
        rows[arm] = ms
        if rank == 0:
            print(f"{arm}: {ms:.2f} ms", flush=True)

    show("local", timed(lambda m=wrapped(stack(layers, width), recompute): step(m, x)))
    m = stack(layers, width)
    for lin in m:
        lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
        parametrize.register_parametrization(lin, "weight", _Gather(mesh, [Replicate()]),
                                             unsafe=True)
    xd = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
    show("dtensor", timed(lambda m=wrapped(m, recompute): step(m, xd)))
    m = stack(layers, width)
    for lin in m:
        fully_shard(lin, mesh=mesh)
    m = wrapped(m, recompute)
    fully_shard(m, mesh=mesh)
    show("fully_shard", timed(lambda: step(m, x)))
    shard = torch.randn(width // world, width, device="cuda")
    whole = torch.empty(width, width, device="cuda")

    def collectives():
        for _ in range(layers * (2 if recompute else 1)):
            dist.all_gather_into_tensor(whole, shard)
        for _ in range(layers):
            dist.reduce_scatter_tensor(shard, whole)
    show("collectives", timed(collectives))
    if rank == 0:
        local, comm = rows["local"], rows["collectives"]
        print(f"\n{layers} x Linear({width}, {width}){' recomputed' if recompute else ''}, {tokens} rows a rank, {world} "
              f"ranks; ms a forward and backward")
        print("| arm | ms | over local | over local, as a share of the collectives alone |")
        print("| --- | ---: | ---: | ---: |")
        for arm in ("local", "dtensor", "fully_shard", "collectives"):
            over = rows[arm] - local
            print(f"| {arm} | {rows[arm]:.2f} | {over:+.2f} | {over / comm:.2f} |" if arm in ("dtensor", "fully_shard")
                  else f"| {arm} | {rows[arm]:.2f} | | |")


if __name__ == "__main__":
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    try:
        main(*(int(a) for a in sys.argv[1:5]) if len(sys.argv) > 1 else (16, 4096, 32768))
    finally:
        dist.destroy_process_group()
