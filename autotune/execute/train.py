"""Training steps of a plan: forward and backward of every micro-batch, the
gradient synchronisation (an all-reduce of each weight's gradient over the
axes where the weight is B, launched as soon as the last micro-batch's
gradient is ready, so that it overlaps the rest of the backward pass as DDP
does), then Adam. With 16-bit activations, weights and gradients are 16-bit
and Adam keeps fp32 master weights (16 bytes per parameter, the plan's memory
model); the optimizer steps one weight at a time (its fp32 gradient made just
before its update and dropped after it, Adam fused on GPUs so that it needs no
temporaries), so the step needs the fp32 gradient of the largest local weight
on top of the 16 bytes (``autotune.sbp.memory``); otherwise everything is in
the activation type.

The steps run back to back as a training loop does: no synchronisation of the
host with the GPU between them (the loss stays on the device until the run
ends), so the host issues a step while the GPU runs the one before and the GPU
waits for the host only where the host is the slower of the two. A step's time
on GPUs is the time between CUDA events recorded on the stream at its start and
at its end (which counts any wait for the host); on CPUs the host's wall time.

Measured per step: that time (median over the steps after --warmup, the
slowest device); the host's time to issue the step (once CUDA's launch queue is
full the host keeps the GPU's pace, so this is near the step time either way:
the GPU's idle time in the profiled steps says whether the host held it back);
the time inside collectives (torch profiler: the NCCL kernels
on GPUs, the gloo operations on CPUs; a kernel's time includes its waiting for
the peer and its slowdown by the compute it overlaps); on GPUs the exposed part
of it (covered by no other GPU activity, ``autotune.execute.trace``) and the
device time by kernel family; the same step's collectives replayed alone
(``autotune.execute.replay``); peak memory per device (GPUs), with the peak of
the forward/backward and of the optimizer step of one step apart; the loss.
"""
from __future__ import annotations

import contextlib
import time

from autotune.execute import trace
from autotune.execute.commlog import Call, CommLog
from autotune.execute.data import batch
from autotune.execute.layerclock import LayerClock, mark, span
from autotune.execute.layout import torch
from autotune.sbp.sbp import B
from calibrate.measure import stats
from calibrate.measure.engine import TorchGroup

dist = torch.distributed


class Trainer:
    def __init__(self, model, graph, d, seed: int, lr: float):
        self.model, self.graph, self.d, self.seed = model, graph, d, seed
        self.params = model.parameters()
        self.mixed = model.ctx.dtype in (torch.bfloat16, torch.float16)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params] if self.mixed else None
        fused = {"fused": True} if d.is_gpu else {}
        # one Adam per weight: stepping one weight at a time costs the host O(weights), where
        # one Adam over all of them would walk every weight at each of their steps
        self.opts = [torch.optim.Adam([w], lr=lr, **fused) for w in (self.masters if self.mixed else self.params)]
        self.log = model.ctx.log = CommLog()
        self.sync = []  # (param, axes) for weights whose gradient is partial somewhere
        for p, _, fine in model.weight_fines():
            axes = tuple(a for a, q in enumerate(fine) if q == B and d.axis_sizes[a] > 1)
            if axes:
                self.sync.append((p, axes))
        self._launching = False
        self._works = []
        axes_of = {id(p): a for p, a in self.sync}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(axes_of[id(p)]))
                         for p in self.params if id(p) in axes_of]

    def close(self) -> None:
        """Drop the hooks (a parameter -> hook -> trainer cycle that the garbage collector
        does not free: it kept every plan's weights and Adam state on the GPU), the optimizer
        and the fp32 masters; the model keeps its weights and last gradients."""
        for h in self._handles:
            h.remove()
        self._handles, self._works, self.sync = [], [], []
        for opt in self.opts:
            opt.state.clear()
        self.opts, self.masters = [], None
        self.params = []
        self.model.ctx.log = None

    def _hook(self, axes):
        group = self.d.group(axes)

        def fire(p):
            if self._launching:
                self.log.add(Call("allreduce", tuple(p.grad.shape), p.grad.dtype, axes=axes))
                self._works.append(dist.all_reduce(p.grad, group=group, async_op=True))
        return fire

    def _sync_device(self):
        if self.d.is_gpu:
            torch.cuda.synchronize(self.d.device)

    def _optimizer_step(self) -> None:
        if not self.mixed:
            for opt in self.opts:
                opt.step()
            return
        for p, m, opt in zip(self.params, self.masters, self.opts):  # one weight at a time: one fp32 gradient alive
            m.grad = p.grad.float()
            opt.step()
            m.grad = None
            with torch.no_grad():
                p.copy_(m)

    def step(self, step: int, probe: dict | None = None, clock: LayerClock | None = None):
        """One training step; returns the loss (mean over the step's tokens), a tensor on the
        device (reading it would make the host wait for the GPU). With ``probe``,
        the peak memory before the step, of its forward/backward and of its optimizer step
        go into it (bytes)."""
        if probe is not None:
            probe["before_step"] = self.d.peak_bytes()
            probe["allocated_at_start"] = torch.cuda.memory_allocated(self.d.device) if self.d.is_gpu else 0
        for p in self.params:
            p.grad = None
        mbs = self.graph.micro_batches
        scale = 1.0 / (self.graph.layers[self.graph.chain[-1]].dim("tokens") * mbs)
        total, replicas = None, 1
        for j in range(mbs):
            data = batch(self.graph, self.seed, step, j, self.d.device, self.model.ctx.dtype)
            self._launching = j == mbs - 1
            if clock:
                clock.micro_batch()
            share, replicas = self.model.forward(data, scale, *((clock.around, clock.after) if clock else ()))
            share.backward()
            if clock:
                clock.backward_done()
            total = share.detach() if total is None else total + share.detach()
        self._launching = False
        for w in self._works:
            w.wait()
        self._works = []
        if probe is not None:
            probe["forward_backward"] = self.d.peak_bytes()
        with clock.optimizer() if clock else contextlib.nullcontext():
            self._optimizer_step()
        if probe is not None:
            probe["optimizer_step"] = self.d.peak_bytes(reset=False)
        loss = total.to(torch.float64)
        dist.all_reduce(loss)
        return loss / replicas

    def run(self, steps: int, warmup: int, profile_steps: int, progress=None) -> dict:
        """Train ``steps`` steps back to back (the last one also records its collectives and its
        memory by phase), then ``profile_steps`` under the profiler, then replay the recorded
        collectives."""
        from autotune.execute.replay import replay

        probe = {}
        if self.d.is_gpu:
            torch.cuda.reset_peak_memory_stats(self.d.device)
        losses, times, issue, clock = self._steps(0, steps, probe, progress, clock_at=warmup)
        timed = times[warmup:]
        step_s = _slowest(stats.median(timed), self.d)
        phases = {k: _slowest(float(v), self.d) for k, v in probe.items()} if self.d.is_gpu else None
        peak = self._peak_memory(max(v for k, v in probe.items() if k != "allocated_at_start") if probe else 0)
        host_s = _slowest(stats.median(issue[warmup:]), self.d)
        out = {"losses": losses, "step_times_s": times, "step_s": step_s, "host_issue_s": host_s,
               "peak_memory_bytes": peak,
               "peak_memory_phases_bytes": phases, "comm_s": None, "comm_source": "not profiled",
               "exposed_comm_s": None, "device_time_s": None, "top_kernels": None, "layer_clock": clock}
        if profile_steps:
            out.update(self._profile(steps, profile_steps, losses))
        out.update(replay(self.log.calls, self.d, self.model.ctx))
        return out

    def _steps(self, first: int, n: int, probe: dict | None = None, progress=None,
               clock_at: int | None = None) -> tuple[list, list, list, dict | None]:
        """Steps ``first`` .. ``first + n - 1`` back to back, after one barrier: (losses, each step's
        time, each step's host issue time, the layer clock's figures). The last step records its
        collectives, and its memory by phase into ``probe``; step ``clock_at`` runs the layer clock
        (a step in the middle of the run: the last one before the device is synchronised is the
        slowest by a few percent)."""
        self._sync_device()
        dist.barrier()
        gpu = self.d.is_gpu
        marks = [mark(gpu)]
        issue, losses = [], []
        clock = LayerClock(self.model.layer_names(), gpu) if clock_at is not None else None
        for s in range(first, first + n):
            last = s == first + n - 1 and probe is not None
            self.log.on = last
            t0 = time.perf_counter()
            losses.append(self.step(s, probe if last else None, clock if s == clock_at else None))
            issue.append(time.perf_counter() - t0)
            marks.append(mark(gpu))
            self.log.on = False
            if progress:
                progress(f"step {s + 1}/{first + n}: issued in {issue[-1] * 1e3:.1f} ms"
                         + ("" if gpu else f", loss {float(losses[-1]):.6g}"))
        self._sync_device()
        times = [span(a, b, gpu) for a, b in zip(marks, marks[1:])]
        figures = self._slowest_clock(dict(clock.result(), step_s=times[clock_at - first])) if clock else None
        return [float(x) for x in losses], times, issue, figures

    def _slowest_clock(self, res: dict) -> dict:
        """The layer clock's figures, each the largest over the devices."""
        vals = [v for layer in res["layers"] for v in (layer["forward_s"], layer["backward_s"])] + \
            [res["optimizer_s"], res["step_s"]]
        slowest = TorchGroup(self.d.device).max([-1.0 if v is None else v for v in vals])
        out = [None if x < 0 else float(x) for x in slowest]
        for i, layer in enumerate(res["layers"]):
            layer["forward_s"], layer["backward_s"] = out[2 * i], out[2 * i + 1]
        return {"layers": res["layers"], "optimizer_s": out[-2], "step_s": out[-1]}

    def _peak_memory(self, peak: int) -> list | None:
        if not self.d.is_gpu:
            return None
        mine = torch.tensor([float(peak)], device=self.d.device)
        out = [torch.zeros_like(mine) for _ in range(self.d.launch.world)]
        dist.all_gather(out, mine)
        return [int(x.item()) for x in out]

    def _profile(self, first_step: int, n: int, losses: list) -> dict:
        return profiled(self.d, n, lambda: losses.extend(self._steps(first_step, n)[0]))


def profiled(d, n: int, run) -> dict:
    """The time in collectives per step of ``run()`` (``n`` steps) under the torch profiler; on GPUs
    also its exposed part, the device's idle time and the device time by kernel family."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.is_gpu else [])
    with profile(activities=acts, acc_events=True) as prof:
        run()
    if not d.is_gpu:
        total = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("gloo:"))
        return {"comm_s": _slowest(total / 1e6 / n, d), "comm_source": "torch profiler: gloo operations (CPU time)"}
    events = device_events(prof)
    comm, busy = trace.split(events)
    return {"comm_s": _slowest(sum(b - a for a, b in comm) / 1e6 / n, d),
            "comm_source": "torch profiler: time inside NCCL kernels (includes their waiting for the peer and "
                           "their slowdown by concurrent compute)",
            "exposed_comm_s": _slowest(trace.exposed_time(comm, busy) / 1e6 / n, d),
            "device_idle_s": _slowest(trace.idle_time(events) / 1e6 / n, d),
            "device_time_s": trace.breakdown(events, n), "top_kernels": trace.top_kernels(events, n)}


def device_events(prof) -> list:
    """This process's GPU activities from a finished profiler, as ``trace.DeviceEvent``."""
    from torch.autograd import DeviceType

    return [trace.DeviceEvent(e.name, e.time_range.start, e.time_range.end, bool(getattr(e, "is_user_annotation", False)))
            for e in prof.events() if e.device_type == DeviceType.CUDA]


def _slowest(x: float, d) -> float:
    """The largest of every rank's ``x`` (the measurement engine's maximum over ranks)."""
    return float(TorchGroup(d.device).max([x])[0])
