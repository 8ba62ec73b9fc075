"""The vocabulary-parallel loss against the fused one, on one GPU (issue 42): the cross entropy of bf16 logits
taken in fp32 as transformers' causal-LM loss takes them, forward and backward, (a) fused (``F.cross_entropy``)
on a rank's local logits [T, V / 2], (b) torch's ``loss_parallel`` on the same local logits as a DTensor split by
vocabulary over torch's fake process group of 2 (every collective a no-op: the device work of one rank),
(c) fused on the same number of elements as data parallelism holds them, [T / 2, V]. Median of ITERS CUDA-event
timings each.

    python3 tests/gpu/loss_parallel.py   # prints a table"""
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

ITERS = int(os.environ.get("ITERS", "10"))


def timed(fn) -> float:
    out = []
    for i in range(ITERS + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out[2:])


def fused(t: int, v: int):
    x = torch.randn(t, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, v, (t,), device="cuda")
    return lambda: F.cross_entropy(x.float(), y).backward()


def parallel(mesh, t: int, v: int):
    local = torch.randn(t, v // 2, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, v, (t,), device="cuda")

    def run():
        x = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=(t, v), stride=(v, 1))
        with loss_parallel():
            F.cross_entropy(x.float(), y).backward()
    return run


def main() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (2,))
    print("| tokens T | vocabulary V | fused [T, V/2] ms | loss_parallel [T, V/2] ms | extra | fused [T/2, V] ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for t, v in ((32768, 128256), (16384, 128256), (32768, 151936), (16384, 32768), (8192, 128256)):
        a, b, c = timed(fused(t, v // 2)), timed(parallel(mesh, t, v)), timed(fused(t // 2, v))
        print(f"| {t} | {v} | {a:.2f} | {b:.2f} | {b / a:.2f}x ({b - a:+.2f} ms) | {c:.2f} |", flush=True)
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
