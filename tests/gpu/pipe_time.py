"""Where a pipelined step's time goes on every rank, beside the plan's simulated timeline: a pipelined plan (PLAN.json's
best or the baseline whose name starts with WHICH) applied to transformers' class of CONFIG.json as a user would
(``apply_pipeline``, ``pipe.step`` under bf16 autocast, fused AdamW), WARMUP steps, then STEPS timed steps in which
each action of torch's schedule (a micro-batch's forward, its loss, its backward, each wait on a batch of sends and
receives) is bracketed by CUDA events and host clocks, then one step under the torch profiler. CAST_EACH_MICRO_BATCH=1:
autocast's weight copies made again before each micro-batch's forward.

    torchrun --nproc-per-node 2 tests/gpu/pipe_time.py PLAN.json CONFIG.json [WHICH] > out.txt

Prints, per rank: the step times and the peak memory allocated; per action kind its device and host milliseconds
summed over the last timed step beside the plan's (forward, backward per micro-batch x micro-batches); the device's
busy and idle time by the profiler; and the last timed step's actions one by one (device start and end beside the
plan's timeline)."""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as schedules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipe_user import forward_backward, report, setup  # noqa: E402

from autotune.execute import trace  # noqa: E402


def main(plan_path: str, config: str, which: str = "") -> None:
    plan, pipe, opt, device = setup(plan_path, config, which)
    actions = []  # (name, host start, host end, device start event, device end event) of the step running

    def timed(name, fn):
        def run(*a, **k):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            c0 = time.perf_counter()
            e0.record()
            out = fn(*a, **k)
            e1.record()
            actions.append((name(a) if callable(name) else name, c0, time.perf_counter(), e0, e1))
            return out
        return run

    st = pipe.schedule._stage

    def recast(*a, _run=st.forward_one_chunk, **k):  # autocast's bf16 weight copies made again for each
        torch.clear_autocast_cache()                   # micro-batch, as a step with an autocast context per
        return _run(*a, **k)                            # micro-batch makes them (the schedule runs in one)

    each = os.environ.get("CAST_EACH_MICRO_BATCH") == "1"
    st.forward_one_chunk = timed(lambda a: f"F{a[0]}", recast if each else st.forward_one_chunk)
    st.backward_one_chunk = timed(lambda a: f"B{a[0]}", st.backward_one_chunk)
    pipe.schedule._maybe_compute_loss = timed(lambda a: f"L{a[3]}", pipe.schedule._maybe_compute_loss)
    schedules._wait_batch_p2p = timed("wait", schedules._wait_batch_p2p)

    def step(i: int) -> None:
        forward_backward(plan, pipe, device, i)
        timed("optimizer", opt.step)()
        opt.zero_grad(set_to_none=True)

    for i in range(int(os.environ.get("WARMUP", "2"))):
        step(i)
    torch.cuda.synchronize(device)
    walls, last = [], None
    torch.cuda.reset_peak_memory_stats(device)
    for i in range(int(os.environ.get("STEPS", "3"))):
        actions.clear()
        dist.barrier()
        torch.cuda.synchronize(device)
        s0, h0 = torch.cuda.Event(enable_timing=True), time.perf_counter()
        s0.record()
        step(100 + i)
        torch.cuda.synchronize(device)
        walls.append(time.perf_counter() - h0)
        last = (s0, h0, list(actions))
    s0, h0, acts = last
    peak = torch.cuda.max_memory_allocated(device)
    rows = [(n, (c1 - c0) * 1e3, s0.elapsed_time(e0), s0.elapsed_time(e1)) for n, c0, c1, e0, e1 in acts]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(200)
        torch.cuda.synchronize(device)
    events = [trace.DeviceEvent(e.name, e.time_range.start, e.time_range.end,
                                bool(getattr(e, "is_user_annotation", False)))
              for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    comm, busy = trace.split(events)
    active = trace.union((e.start, e.end) for e in events if not e.annotation and e.end > e.start)
    s, mb = plan.stages[pipe.stage], plan.micro_batches
    lines = [f"rank {dist.get_rank()} stage {pipe.stage} ({s.blocks} blocks): steps "
             f"{', '.join(f'{w * 1e3:.1f}' for w in walls)} ms (median {statistics.median(walls) * 1e3:.1f}), peak "
             f"{peak / 2 ** 30:.2f} GiB; plan: step {plan.costs.step_s * 1e3:.1f} ms, this stage's last backward "
             f"ends at {s.end_s * 1e3:.1f} ms, forward {s.forward_s * 1e3:.2f} and backward {s.backward_s * 1e3:.2f} "
             f"ms a micro-batch, optimizer {s.optimizer_s * 1e3:.2f} ms, host pass "
             f"{(s.host_pass_s or 0) * 1e3:.2f} ms, memory {s.memory_bytes / 2 ** 30:.2f} GiB"]
    for kind, pred in (("F", s.forward_s * mb), ("L", None), ("B", s.backward_s * mb), ("wait", None),
                       ("optimizer", s.optimizer_s)):
        sel = [r for r in rows if (r[0] == kind if len(kind) > 1 else r[0][0] == kind and r[0][1:].isdigit())]
        if sel:
            dev, host = sum(r[3] - r[2] for r in sel), sum(r[1] for r in sel)
            lines.append(f"  {kind:9s} x{len(sel):3d}: device {dev:9.1f} ms, host {host:9.1f} ms"
                         + (f"; plan {pred * 1e3:9.1f} ms ({(dev / 1e3 - pred) / pred:+.1%})" if pred else ""))
    if active:
        lines.append(f"  profiled step: device span {(active[-1][1] - active[0][0]) / 1e3:.1f} ms, busy "
                     f"{sum(b - a for a, b in trace.union(busy)) / 1e3:.1f} ms (communication alone "
                     f"{trace.exposed_time(comm, busy) / 1e3:.1f} ms), idle {trace.idle_time(events) / 1e3:.1f} ms; "
                     f"by family "
                     + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in trace.breakdown(events, 1).items()))
    plan_at = {f"{k}{j}": (a * 1e3, b * 1e3) for k, j, a, b in s.timeline}
    lines.append("  action      host ms   device start..end ms   (plan start..end ms)")
    for n, host, a, b in rows:
        p = plan_at.get(n)
        lines.append(f"  {n:10s} {host:8.2f}   {a:9.2f}..{b:9.2f}" + (f"   ({p[0]:9.2f}..{p[1]:9.2f})" if p else ""))
    report(lines)


if __name__ == "__main__":
    main(*sys.argv[1:])
