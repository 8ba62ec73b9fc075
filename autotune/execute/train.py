"""Training steps of a plan: forward and backward of every micro-batch, the
gradient synchronisation (an all-reduce of each weight's gradient over the
axes where the weight is B, launched as soon as the last micro-batch's
gradient is ready, so that it overlaps the rest of the backward pass as DDP
does), then Adam. With 16-bit activations, weights and gradients are 16-bit
and Adam keeps fp32 master weights (16 bytes per parameter, the plan's memory
model); otherwise everything is in the activation type.

Measured per step: wall time (median over the steps after --warmup, the
slowest device), time inside collectives (torch profiler: the NCCL kernels on
GPUs, the gloo operations on CPUs; a kernel's time includes its waiting for
the peer and its slowdown by the compute it overlaps), on GPUs the exposed part
of it (covered by no compute kernel), peak memory per device (GPUs) and the loss.
"""
from __future__ import annotations

import statistics
import time

from autotune.execute.data import batch
from autotune.execute.layout import torch
from autotune.sbp.sbp import B

dist = torch.distributed
NCCL = ("ncclDevKernel", "ncclKernel")


class Trainer:
    def __init__(self, model, graph, d, seed: int, lr: float):
        self.model, self.graph, self.d, self.seed = model, graph, d, seed
        self.params = model.parameters()
        self.mixed = model.ctx.dtype in (torch.bfloat16, torch.float16)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params] if self.mixed else None
        self.opt = torch.optim.Adam(self.masters if self.mixed else self.params, lr=lr)
        self.sync = []  # (param, group) for weights whose gradient is partial somewhere
        for p, _, fine in model.weight_fines():
            axes = tuple(a for a, q in enumerate(fine) if q == B and d.axis_sizes[a] > 1)
            if axes:
                self.sync.append((p, d.group(axes)))
        self._launching = False
        self._works = []
        groups = {id(p): g for p, g in self.sync}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(groups[id(p)]))
                         for p in self.params if id(p) in groups]

    def close(self) -> None:
        """Drop the hooks (a parameter -> hook -> trainer cycle that the garbage collector
        does not free: it kept every plan's weights and Adam state on the GPU), the optimizer
        and the fp32 masters; the model keeps its weights and last gradients."""
        for h in self._handles:
            h.remove()
        self._handles, self._works, self.sync = [], [], []
        self.opt.state.clear()
        self.opt = self.masters = None
        self.params = []

    def _hook(self, group):
        def fire(p):
            if self._launching:
                self._works.append(dist.all_reduce(p.grad, group=group, async_op=True))
        return fire

    def _sync_device(self):
        if self.d.is_gpu:
            torch.cuda.synchronize(self.d.device)

    def step(self, step: int) -> float:
        """One training step; returns the loss (mean over the step's tokens)."""
        for p in self.params:
            p.grad = None
        mbs = self.graph.micro_batches
        scale = 1.0 / (self.graph.layers[self.graph.chain[-1]].dim("tokens") * mbs)
        total, replicas = None, 1
        for j in range(mbs):
            data = batch(self.graph, self.seed, step, j, self.d.device, self.model.ctx.dtype)
            self._launching = j == mbs - 1
            share, replicas = self.model.forward(data, scale)
            share.backward()
            total = share.detach() if total is None else total + share.detach()
        self._launching = False
        for w in self._works:
            w.wait()
        self._works = []
        if self.mixed:
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.float()
        self.opt.step()
        if self.mixed:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        loss = total.to(torch.float64)
        dist.all_reduce(loss)
        return float(loss) / replicas

    def run(self, steps: int, warmup: int, profile_steps: int, progress=None) -> dict:
        losses, times = [], []
        if self.d.is_gpu:
            torch.cuda.reset_peak_memory_stats(self.d.device)
        for s in range(steps):
            self._sync_device()
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(self.step(s))
            self._sync_device()
            times.append(time.perf_counter() - t0)
            if progress:
                progress(f"step {s + 1}/{steps}: loss {losses[-1]:.6g}, {times[-1] * 1e3:.1f} ms")
        timed = times[warmup:] or times
        step_s = _slowest(statistics.median(timed), self.d)
        peak = self._peak_memory()
        comm_s, comm_how, exposed = (self._profile(steps, profile_steps, losses) if profile_steps
                                     else (None, "not profiled", None))
        return {"losses": losses, "step_times_s": times, "step_s": step_s, "comm_s": comm_s, "comm_source": comm_how,
                "exposed_comm_s": exposed,
                "peak_memory_bytes": peak}

    def _peak_memory(self) -> list | None:
        if not self.d.is_gpu:
            return None
        mine = torch.tensor([float(torch.cuda.max_memory_allocated(self.d.device))], device=self.d.device)
        out = [torch.zeros_like(mine) for _ in range(self.d.launch.world)]
        dist.all_gather(out, mine)
        return [int(x.item()) for x in out]

    def _profile(self, first_step: int, n: int, losses: list) -> tuple[float | None, str, float | None]:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.d.is_gpu else [])
        with profile(activities=acts) as prof:
            for s in range(first_step, first_step + n):
                losses.append(self.step(s))
            self._sync_device()
        total = 0.0
        for e in prof.key_averages():
            if self.d.is_gpu and e.key.startswith(NCCL):
                total += e.self_device_time_total
            elif not self.d.is_gpu and e.key.startswith("gloo:"):
                total += e.cpu_time_total
        how = ("torch profiler: time inside NCCL kernels (includes their waiting for the peer and their slowdown "
               "by concurrent compute)" if self.d.is_gpu else "torch profiler: gloo operations (CPU time)")
        exposed = _slowest(exposed_time(*kernel_intervals(prof)) / 1e6 / n, self.d) if self.d.is_gpu else None
        return _slowest(total / 1e6 / n, self.d), how, exposed


def kernel_intervals(prof) -> tuple[list, list]:
    """(NCCL kernel intervals, other kernel intervals) on this process's GPU, in microseconds."""
    from torch.autograd import DeviceType

    comm, other = [], []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            (comm if e.name.startswith(NCCL) else other).append((e.time_range.start, e.time_range.end))
    return comm, other


def _union(intervals) -> list:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def exposed_time(comm, compute) -> float:
    """Length of the time covered by a ``comm`` interval and by no ``compute`` interval."""
    total, busy = 0.0, _union(compute)
    for a, b in _union(comm):
        covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy if x < b and y > a)
        total += (b - a) - covered
    return total


def _slowest(x: float, d) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
