"""Where a single-stage plan's step goes, micro-batch by micro-batch (issue 42): PLAN.json's candidates whose names
start with each WHICH ("best" for the best) run as ``autotune tune`` runs them (execute's runner: ``autotune.apply``,
``ModuleTrainer``, transformers' class of CONFIG.json), each micro-batch's forward and backward bracketed by host
clocks and CUDA events; then the same plan at HOST_SEQUENCE tokens (default 128: the device keeps up, so the host's
issue time per phase is the host's alone; 0: not run); then one step under the profiler with CPU activities (the
host's waits on the device, by call).

    torchrun --nproc-per-node 2 tests/gpu/step_time.py PLAN.json CONFIG.json best "FSDP" "data parallel"

Per candidate and rank: the step; per phase (forward, backward, optimizer) summed over the step, the host's and the
device's milliseconds, and the host's alone at the short sequence; the device's lag behind the host at each phase's
end (0: the device waited for the host); the syncs; and the profiled step's device time by kernel (KERNELS, the
largest first). Each rank prints each timed step's milliseconds and phases as it ends."""
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from autotune.execute import moduletrain, runner
from autotune.execute.env import start, stop
from autotune.plan.file import PlanFile
from autotune.plan.typed import ModelSpec

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpy",
         "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


class Marks:
    """(label, host clock, CUDA event) at each phase boundary of the running step."""

    def __init__(self):
        self.rows, self.on = [], False

    def __call__(self, label: str) -> None:
        if self.on:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.rows.append((label, time.perf_counter(), e))


MARKS = Marks()
_forward_loss = moduletrain.forward_loss


def traced_forward_loss(model, ids, targets):
    MARKS("F")
    loss = _forward_loss(model, ids, targets)
    MARKS("B")
    return loss


class Traced(moduletrain.ModuleTrainer):
    """The runner's trainer, each step's phases marked; ``run`` keeps the steps' times, the last step's phases and
    (PROFILE) one more step's syncs in ``Traced.found``."""
    found: dict = {}
    profile = False

    def step(self, step: int, probe=None):
        MARKS.rows.clear()
        torch.cuda.synchronize(self.d.device)
        MARKS.on = True
        MARKS("start")
        self.opt.zero_grad(set_to_none=True)
        total = self.forward_backward(step)
        MARKS("O")
        self.opt.step()
        MARKS("end")
        torch.cuda.synchronize(self.d.device)
        MARKS.on = False
        return total

    def run(self, steps: int, warmup: int, profile_steps: int, progress=None) -> dict:
        times = []
        for s in range(steps):
            t0 = time.perf_counter()
            self.step(s)
            times.append(time.perf_counter() - t0)
            ph, _ = phases(MARKS.rows)  # printed as each step ends: a run stopped early keeps what it measured
            print(f"[rank {dist.get_rank()}] step {s}: {times[-1] * 1e3:.1f} ms; host / device ms " + ", ".join(
                f"{k} {h:.1f} / {e:.1f}" for k, (h, e) in ph.items()), flush=True)
        Traced.found = {"times": times, "phases": phases(MARKS.rows)}
        if Traced.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                self.step(steps)
            Traced.found["waits"] = {e.key: (e.count, e.cpu_time_total / 1e3) for e in prof.key_averages()
                                     if any(e.key.startswith(s) for s in SYNCS)}
            kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
            Traced.found["kernels"] = sorted(((e.self_device_time_total / 1e3, e.count, e.key[:90]) for e in kernels),
                                             reverse=True)[:int(os.environ.get("KERNELS", "25"))]
        return {"step_s": statistics.median(times[warmup:])}


def phases(rows):
    """{phase: (host ms, device ms)} summed over the step, and the device's lag behind the host (ms) at each
    boundary: phase F runs from an "F" mark to the next "B", B from "B" to the next "F" or "O", O from "O" to
    "end"."""
    _, h0, e0 = rows[0]
    out, lags = {}, []
    for (a, ha, ea), (_, hb, eb) in zip(rows[1:], rows[2:]):
        host, dev = out.get(a, (0.0, 0.0))
        out[a] = (host + (hb - ha) * 1e3, dev + ea.elapsed_time(eb))
        lags.append((a, e0.elapsed_time(eb) - (hb - h0) * 1e3))
    return out, lags


def run(plan, d, config: str, steps: int, profiled: bool) -> dict:
    """The runner on ``plan`` with the traced trainer: ``Traced.found``."""
    runner.ModuleTrainer, moduletrain.forward_loss, Traced.profile = Traced, traced_forward_loss, profiled
    runner.run_module_plan(plan, d, module=config, steps=steps, warmup=1, profile_steps=0)
    runner.free_device(d)
    return Traced.found


def main(plan_path: str, config: str, *which: str) -> None:
    d = start("cuda")
    pf = PlanFile.load(plan_path)
    short = int(os.environ.get("HOST_SEQUENCE", "128"))
    for w in which or ("best",):
        lines = []
        plan = pf.best if w == "best" else next(p for p in pf.baselines if p.strategy.startswith(w))
        c = plan.costs
        got = run(plan, d, config, int(os.environ.get("STEPS", "3")), True)
        quick = run(replace(plan, model=ModelSpec(plan.model.kind, dict(plan.model.config, sequence=short))), d,
                    config, 3, False) if short else {"times": [0.0, 0.0], "phases": ({}, [])}
        (ph, lags), (qph, _) = got["phases"], quick["phases"]
        times = got["times"]
        lines.append(f"rank {dist.get_rank()} {plan.strategy} [{plan.apply_path}]: steps "
                     f"{', '.join(f'{t * 1e3:.1f}' for t in times)} ms (median after the first "
                     f"{statistics.median(times[1:]) * 1e3:.1f}); plan step {c.step_s * 1e3:.1f}, compute "
                     f"{c.compute_s * 1e3:.1f}, host {(c.host_step_s or 0) * 1e3:.1f} ms; at {short} tokens "
                     f"{statistics.median(quick['times'][1:]) * 1e3:.1f} ms")
        for k in ("F", "B", "O"):
            host, dev = ph.get(k, (0, 0))
            lines.append(f"  {k}: host {host:8.1f} ms, device {dev:8.1f} ms; host alone ({short} tokens) "
                         f"{qph.get(k, (0, 0))[0]:8.1f} ms")
        lines.append("  lag at each phase's end (ms): " + " ".join(f"{a}{x:.0f}" for a, x in lags))
        lines.append("  syncs in a profiled step: " + (", ".join(
            f"{k} x{n} {t:.1f} ms" for k, (n, t) in sorted(got.get("waits", {}).items())) or "none"))
        lines += [f"    {t:8.2f} ms x{n:5d} {k}" for t, n, k in got.get("kernels", [])]
        out = [None] * dist.get_world_size()  # printed as each candidate ends: a run stopped early keeps them
        dist.all_gather_object(out, "\n".join(lines))
        if dist.get_rank() == 0:
            print("\n".join(out), flush=True)
    stop(d)


if __name__ == "__main__":
    main(*sys.argv[1:])
