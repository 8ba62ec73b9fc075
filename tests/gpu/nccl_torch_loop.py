"""A small torch.distributed allreduce loop, to show that a PyTorch job picks the NCCL tuner
plugin up from its environment (the env file of python -m autotune nccl):

    torchrun --nproc-per-node 2 tests/gpu/nccl_torch_loop.py OUT.json [--plugin LIB]

Times allreduce of 1 KiB .. 256 MiB (20 calls, CUDA events, median of 5, maximum over
ranks), checks every result, and reports how many calls the plugin decided in this process
(the plugin's own counter, read from the library NCCL loaded) when --plugin names it.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os

import torch
import torch.distributed as dist

SIZES = [1 << k for k in range(10, 29, 3)]   # 1 KiB .. 256 MiB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--plugin", default=None)
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    try:
        for n in SIZES:
            x = torch.full((n // 4,), float(rank + 1), device=dev)
            for _ in range(5):
                dist.all_reduce(x)
            times = []
            for _ in range(5):
                x.fill_(float(rank + 1))
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    dist.all_reduce(x)
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) * 1e3 / 20)
            x.fill_(float(rank + 1))
            dist.all_reduce(x)
            want = world * (world + 1) / 2
            wrong = int((x != want).sum().item())
            t = torch.tensor([sorted(times)[2], wrong], device=dev, dtype=torch.float64)
            dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(t[1:], op=dist.ReduceOp.SUM)
            rows.append({"bytes": n, "median_us": t[0].item(), "wrong": int(t[1].item())})
        decided = None
        if args.plugin:
            decided = ctypes.c_ulong.in_dll(ctypes.CDLL(args.plugin), "commtune_tuner_decided").value
        if rank == 0:
            with open(args.out, "w") as f:
                json.dump({"kind": "commtune.nccl-torch-loop", "version": 1, "torch": torch.__version__,
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "ranks": world,
                           "plugin": args.plugin, "plugin_decided_calls_rank0": decided, "rows": rows}, f, indent=1)
            for r in rows:
                print(f"allreduce {r['bytes']:>10} B {r['median_us']:10.2f} us  #wrong {r['wrong']}")
            print(f"plugin decided calls on rank 0: {decided}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
