"""Compute's slowdown beside communication (the profile's ``compute.overlap``), measured by ``python -m
calibrate compute``.

DDP overlaps its gradient all-reduces with the backward, FSDP its all-gathers and reduce-scatters with
the layers' compute: the matmuls then share the GPU's memory system and SMs with NCCL's kernels and run
slower than alone. Measured: a long bf16 matmul (``MATMUL`` cubed, about 1.2 ms on an H200) timed alone
and beside each collective (``OVERLAP_COLLECTIVES``, ``COLLECTIVE_BYTES``: longer than the matmul, so it
covers it all) issued just before it on a second stream, two arms of the engine interleaved in rounds
(``calibrate.measure``; CUDA events on the matmul's stream, the next call waits for the collective). The
slowdown is the matmul's median beside it over its median alone. On 2 or more GPUs the collective runs
between 2 of them (NCCL, a process each: ``peer`` "nccl"); with one GPU, a device-to-device copy of the
same bytes stands in for every collective (``peer`` "copy": the memory traffic, not NCCL's SMs).
"""
from __future__ import annotations

from calibrate.compute import OVERLAP_COLLECTIVES
from calibrate.device.peers import run_peers
from calibrate.measure.engine import Solo, TorchGroup, compare
from calibrate.measure.torcharm import TorchArm, timing

MATMUL = 8192
COLLECTIVE_BYTES = 1 << 30


def _arms(torch, device, side, issue: dict):
    """The engine's arms: the matmul alone, and beside each of ``issue`` (name -> issue one on the current stream)."""
    a, b = (torch.randn(MATMUL, MATMUL, device=device, dtype=torch.bfloat16) for _ in range(2))
    main = torch.cuda.current_stream(device)

    def beside(fn):
        def call(i):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                fn()
            torch.mm(a, b)
        return call

    arms = [("alone", lambda: TorchArm(torch, device, lambda i: torch.mm(a, b)))]
    arms += [(name, (lambda f: lambda: TorchArm(torch, device, beside(f), lambda: main.wait_stream(side)))(fn))
             for name, fn in issue.items()]
    return arms


def slowdowns(torch, device, group, issue: dict, iters: int, warmup: int) -> dict:
    """name -> the matmul's median beside it over its median alone (module docstring)."""
    side = torch.cuda.Stream(device)
    res = compare(group, _arms(torch, device, side, issue), timing(iters, warmup, back_to_back=True))
    bad = [f"{n}: {a.reason}" for n, a in res.arms.items() if not a.ok]
    if bad:
        raise RuntimeError("; ".join(bad))
    alone = res.arms["alone"].median_s
    return {name: res.arms[name].median_s / alone for name in issue}


def _peer_job(torch, device, world: int, iters: int, warmup: int) -> dict:
    """The matmul's slowdowns beside NCCL collectives on one of ``calibrate.device.peers``' ranks."""
    dist = torch.distributed
    n = COLLECTIVE_BYTES // 2
    full = torch.randn(n, device=device, dtype=torch.bfloat16)
    part = torch.empty(n // world, device=device, dtype=torch.bfloat16)
    issue = {"all_reduce": lambda: dist.all_reduce(full),
             "all_gather": lambda: dist.all_gather_into_tensor(full, part),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full)}
    return slowdowns(torch, device, TorchGroup(device), issue, iters, warmup)


def measure_overlap(torch, iters: int, warmup: int, progress) -> dict:
    """The profile's ``overlap`` figures: beside NCCL collectives between 2 GPUs where 2 are visible, else beside a
    copy on this one (module docstring)."""
    if torch.cuda.device_count() >= 2:
        got = run_peers(_peer_job, (iters, warmup), what="compute's slowdown beside collectives")
        out = {k: float(v) for k, v in got.items()}
        peer = "nccl"
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        n = COLLECTIVE_BYTES // 2
        src = torch.randn(n, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        s = slowdowns(torch, device, Solo(), {"copy": lambda: dst.copy_(src)}, iters, warmup)["copy"]
        out = {c: s for c in OVERLAP_COLLECTIVES}
        peer = "copy"
    progress("overlap (matmul beside " + ("NCCL collectives between 2 GPUs" if peer == "nccl" else
                                          "a device copy: one GPU, no peer, a stand-in") + "): "
             + ", ".join(f"{k} x{v:.3f}" for k, v in out.items()))
    return {**{k: max(0.5, min(5.0, v)) for k, v in out.items()}, "peer": peer}
