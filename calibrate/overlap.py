"""Compute's slowdown beside communication (the ``overlap`` figures of a profile's compute section, and of its module
section), measured by ``python -m calibrate compute`` and ``python -m calibrate module``.

DDP overlaps its gradient all-reduces with the backward, FSDP its all-gathers and reduce-scatters with the layers'
compute: the compute then shares the GPU's SMs and memory with NCCL's kernels and runs slower than alone. Measured:
a stretch of compute timed alone and beside a stream of back-to-back collectives (``OVERLAP_COLLECTIVES``) issued
on a second stream just before it, as many as take ``COVER`` times the compute alone (``covering``: the compute
runs beside them from its first kernel to its last), two arms of the engine interleaved in rounds
(``calibrate.measure``; CUDA events on the compute's stream, the next call waits for the collectives). The slowdown
is the compute's median beside them over its median alone: the step model slows the compute that runs beside a
collective by it (``autotune.sbp.steptime.fsdp_seconds``, ``overlapped``). The compute:

- ``calibrate compute``: a matmul stream (``MATMULS``: the bf16 products of a transformer block's forward at
  ``TOKENS`` tokens, shapes of several tile counts) beside collectives of ``COLLECTIVE_BYTES``. One product of
  8192 cubed lost 0.3% beside NCCL where a 1.5 B Llama's products lost 4.7% beside fully_shard's collectives (2 x
  H200, 2026-11-30): the SMs NCCL holds cost a product of one shape nothing while its last wave still fits;
- ``calibrate module``: the user's model of ``1 + MORE`` blocks, its forward and backward under autocast as users
  run it, beside collectives of one block's fp32 parameters (what fully_shard gathers and reduce-scatters a unit).

On 2 or more GPUs the collectives run between 2 of them (NCCL, a process each: ``peer`` "nccl"); with one GPU a
device-to-device copy of the same bytes stands in for every collective (``peer`` "copy": the memory traffic, not
NCCL's SMs; the compute section only).
"""
from __future__ import annotations

import contextlib
import math

from calibrate.compute import OVERLAP_COLLECTIVES
from calibrate.device.peers import run_peers
from calibrate.measure.engine import Solo, TorchGroup, compare
from calibrate.measure.torcharm import TorchArm, mark, span, timing

HIDDEN, TOKENS = 4096, 8192
# (k, n) of each product of the block's forward at TOKENS tokens: attention's Q, K / V and output, the MLP's gate /
# up and down (Llama's proportions at HIDDEN)
MATMULS = ((HIDDEN, HIDDEN), (HIDDEN, HIDDEN // 4), (HIDDEN, HIDDEN), (HIDDEN, 14336), (14336, HIDDEN))
COLLECTIVE_BYTES = 256 << 20  # one unit of a few-billion-parameter model in fp32, as fully_shard gathers it
COVER = 1.25  # the collectives issued beside the compute take this many times the compute alone
MOST_COLLECTIVES = 4096  # covering's bound (a compute far longer than a collective: the stream is no longer)


def _stream(torch, device):
    """(a second stream on ``device``, entered by ``torch.cuda.stream``), or None on the CPU (tests)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _arms(torch, device, side, compute, issue: dict):
    """The engine's arms: ``compute`` (a call issues it on the current stream) alone, and beside each of ``issue``
    (name -> issue the collectives on the current stream), issued on ``side`` first."""
    main = torch.cuda.current_stream(device) if side is not None else None

    def beside(fn):
        def call(i):
            if side is not None:
                side.wait_stream(main)
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                fn()
            compute(i)
        return call

    after = (lambda: main.wait_stream(side)) if side is not None else None
    arms = [("alone", lambda: TorchArm(torch, device, compute))]
    arms += [(name, (lambda f: lambda: TorchArm(torch, device, beside(f), after))(fn)) for name, fn in issue.items()]
    return arms


def slowdowns(torch, device, group, compute, issue: dict, iters: int, warmup: int) -> dict:
    """name -> ``compute``'s median beside ``issue[name]`` over its median alone (module docstring)."""
    res = compare(group, _arms(torch, device, _stream(torch, device), compute, issue),
                  timing(iters, warmup, back_to_back=True))
    bad = [f"{n}: {a.reason}" for n, a in res.arms.items() if not a.ok]
    if bad:
        raise RuntimeError("; ".join(bad))
    alone = res.arms["alone"].median_s
    return {name: res.arms[name].median_s / alone for name in issue}


def _seconds(torch, device, fn, calls: int = 3) -> float:
    """A call of ``fn`` (after one untimed), seconds: the mean of ``calls`` back to back."""
    cuda = device.type == "cuda"
    fn(0)
    a = mark(torch, cuda)
    for i in range(calls):
        fn(i + 1)
    b = mark(torch, cuda)
    if cuda:
        torch.cuda.synchronize(device)
    return span(a, b, cuda) / calls


def covering(torch, device, group, compute, one: dict) -> dict:
    """name -> how many of ``one[name]`` (one collective) back to back take ``COVER`` times ``compute`` alone, the
    most any rank needs (every rank issues as many). A collective's time is read twice: from 3 calls, then from as
    many as that first reading says cover the compute (a stretch as long as the arm's, so one late call or a
    scheduler's hiccup moves the count by its share of the stretch, not by a factor)."""
    c = _seconds(torch, device, compute)

    def need(fn, calls, k=1):  # fn issues k collectives
        return min(MOST_COLLECTIVES, max(1, math.ceil(COVER * c * k / max(_seconds(torch, device, fn, calls), 1e-9))))

    names = list(one)
    first = [int(k) for k in group.max([need(lambda i, f=one[n]: f(), 3) for n in names])]  # ranks issue alike
    counts = [need(lambda i, f=one[n], k=k: [f() for _ in range(k)], 1, k) for n, k in zip(names, first)]
    return dict(zip(names, (int(x) for x in group.max(counts))))


def streams(torch, device, group, compute, one: dict, iters: int, warmup: int) -> dict:
    """name -> ``compute``'s slowdown beside a covering stream of ``one[name]`` (``covering``, ``slowdowns``)."""
    counts = covering(torch, device, group, compute, one)
    issue = {name: (lambda f, k: lambda: [f() for _ in range(k)])(one[name], counts[name]) for name in one}
    return slowdowns(torch, device, group, compute, issue, iters, warmup)


def collectives(torch, device, world: int, nbytes: int) -> dict:
    """``OVERLAP_COLLECTIVES`` of ``nbytes`` (fp32, the gathered / reduced size) on the default process group."""
    dist = torch.distributed
    n = max(world, nbytes // 4 // world * world)
    full = torch.randn(n, device=device)
    part = torch.empty(n // world, device=device)
    return {"all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full)}


def matmul_stream(torch, device):
    """``MATMULS`` as one call (bf16, ``TOKENS`` rows): the compute of ``calibrate compute``'s figures."""
    x = torch.randn(TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
    ws = [torch.randn(k, n, device=device, dtype=torch.bfloat16) for k, n in MATMULS]
    inputs = [x if k == HIDDEN else torch.randn(TOKENS, k, device=device, dtype=torch.bfloat16) for k, _ in MATMULS]
    return lambda i: [torch.mm(a, w) for a, w in zip(inputs, ws)]


def module_compute(torch, device, recipe: tuple, micro_batch: int, sequence: int):
    """(the forward and backward of the user's ``1 + MORE``-block model as one call, one block's fp32 parameter
    bytes): the compute of ``calibrate module``'s figures (``calibrate.usermodule``'s ``recipe``)."""
    from calibrate.modulehost import blocks_of
    from calibrate.usermodule import MORE, Timed, rebuild
    um = rebuild(recipe)
    m = Timed(torch, um, 1 + MORE, 1, device)
    m.inputs(micro_batch, sequence, um.model["vocabulary"])
    first = blocks_of(torch, m.model)[:1]
    return m.both, 4 * sum(p.numel() for b in first for p in b.parameters())


def overlap_job(torch, device, world: int, recipe, micro_batch: int, sequence: int, iters: int, warmup: int) -> dict:
    """The slowdowns on one rank of a process group (``run_peers``' job): beside collectives among the group's
    ranks, of the matmul stream (``recipe`` None) or of the user's module."""
    if recipe is None:
        compute, nbytes = matmul_stream(torch, device), COLLECTIVE_BYTES
    else:
        compute, nbytes = module_compute(torch, device, recipe, micro_batch, sequence)
    return streams(torch, device, TorchGroup(device), compute, collectives(torch, device, world, nbytes), iters,
                   warmup)


def measure_overlap(torch, iters: int, warmup: int, progress) -> dict:
    """The compute section's ``overlap``: the matmul stream beside NCCL collectives between 2 GPUs where 2 are
    visible, else beside a copy on this one (module docstring)."""
    if torch.cuda.device_count() >= 2:
        out = run_peers(overlap_job, (None, 0, 0, iters, warmup), what="compute's slowdown beside collectives")
        peer = "nccl"
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        src = torch.randn(COLLECTIVE_BYTES // 4, device=device)
        dst = torch.empty_like(src)
        s = streams(torch, device, Solo(), matmul_stream(torch, device), {"copy": lambda: dst.copy_(src)}, iters,
                    warmup)["copy"]
        out = {c: s for c in OVERLAP_COLLECTIVES}
        peer = "copy"
    progress("overlap (a matmul stream beside " + ("NCCL collectives between 2 GPUs" if peer == "nccl" else
                                                   "a device copy: one GPU, no peer, a stand-in") + "): "
             + ", ".join(f"{k} x{v:.3f}" for k, v in out.items()))
    return {**bounded(out), "peer": peer}


def module_overlap(torch, recipe: tuple, micro_batch: int, sequence: int, iters: int, warmup: int, progress) -> dict:
    """The module section's ``overlap``: the user's model beside NCCL collectives of one block's fp32 parameters
    between 2 GPUs; {} (the compute section's figures stand) where fewer than 2 GPUs are visible."""
    if not recipe or torch.cuda.device_count() < 2:
        progress("overlap on the module: not measured (one GPU: the compute section's figures stand)")
        return {}
    out = run_peers(overlap_job, (recipe, micro_batch, sequence, iters, warmup),
                    what="the module's slowdown beside collectives")
    progress(f"overlap on the module (micro-batch {micro_batch}, sequence {sequence}, beside NCCL collectives of a "
             "block's fp32 parameters between 2 GPUs): " + ", ".join(f"{k} x{v:.3f}" for k, v in out.items()))
    return {**bounded(out), "peer": "nccl"}


def bounded(figures: dict) -> dict:
    """The figures within the loader's range (0.5 to 5: ``calibrate.compute.overlap_figures``)."""
    return {k: max(0.5, min(5.0, float(v))) for k, v in figures.items()}
