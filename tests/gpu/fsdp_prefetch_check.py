"""Issue 42's check of the forward all-gathers under FSDP2's implicit prefetch (``autotune.sbp.steptime.
implicit_prefetch_exposed``): transformers' LlamaForCausalLM of run 4 (``apply_llama.SHAPE``, each rank 4 sequences
a micro-batch, 2 micro-batches) under fully_shard as ``autotune.apply.fsdp`` places it (each decoder layer a unit,
the model the root), fp32 weights, bf16 autocast, fused AdamW. Measures what the model assumes:

- host: the CPU's issue time of one micro-batch's forward and of its backward (the device synchronised before
  each; CPU clock), at run 4's micro-batch and at the host-bound one of ``calibrate``'s host figures (1 sequence
  of 512 tokens): the forward's share of the host (``FORWARD_HOST_SHARE``: 0.5 assumed);
- device: each micro-batch's forward and backward on the device (CUDA events), the device synchronised before
  the step;
- step: the median step with steps back to back (execute's loop: the CPU's lead carries across steps) and with
  the loss read after each step (``loss.item()``: the lead zero at each step's start, as the model assumes).

With ``--profile PROFILE``, beside them the model's forward of a micro-batch started with the CPU's lead at zero
(what the host and device rows measure): the CPU's issue time plus the device's backlog when it is done
(``implicit_prefetch_exposed``), at ``FORWARD_HOST_SHARE`` and at the share measured here.

    torchrun --nproc-per-node N tests/gpu/fsdp_prefetch_check.py OUT [--small] [--device cpu] [--profile PROFILE]

JSON in OUT/fsdp_prefetch.json; a table last."""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from apply_llama import SHAPE, SMALL, build  # noqa: E402

STEPS, WARMUP = 8, 3


def predicted(profile: str, gpus: int, hosts: dict) -> dict:
    """The model's forward of run 4's first micro-batch (lead zero) on ``gpus`` devices: per host (name -> the
    forward's share of the host's issue time and, or None, the forward's issue time to scale the profile's host
    figure to), (predicted forward device seconds, of which the all-gathers exposed)."""
    from calibrate.profile import Profile
    from models import load_model

    from autotune.plan.build import gather_figures
    from autotune.sbp.baselines import data_parallel
    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.memory import Mode
    from autotune.sbp.mesh import Cluster
    from autotune.sbp.steptime import fsdp_units, implicit_prefetch_exposed
    prof = Profile.load(profile)
    graph = load_model("llama", None, dict(SHAPE, batch=8 * gpus, micro_batch=4 * gpus))
    pr = Problem(graph, Coster(prof, Cluster(1, gpus)), require_fit=False, objective="step").with_mode(
        Mode(fsdp_axes=(0,)))
    figures = gather_figures(pr, data_parallel(pr))
    if figures is None:
        return {}
    fwd, _, gather, _, host = figures
    out = {}
    for name, (share, issue) in hosts.items():
        factor = 1.0 if issue is None else issue / (share * sum(host))
        units = fsdp_units(graph.chain, graph.blocks, fwd, gather, [factor * h for h in host], share)
        exposed, backlog = implicit_prefetch_exposed(units)
        out[name] = (sum(u[1] for u in units) + backlog, exposed)
    return out


def main(out: Path, small: bool, device: str, profile: str | None = None) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard

    from autotune.execute.env import start, stop
    d = start(device)
    world, gpu = d.launch.world, d.is_gpu
    shape = dict(SMALL if small else SHAPE, micro_batch=4)  # each rank's micro-batch, as on 4 GPUs
    try:
        torch.manual_seed(0)
        model = build(shape).to(d.device)
        for unit in list(model.model.layers) + [model]:
            fully_shard(unit)
            if not gpu:  # gloo: neither the pre-multiplied sum nor the average
                unit.set_force_sum_reduction_for_comms(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=gpu)
        sync = (lambda: torch.cuda.synchronize(d.device)) if gpu else (lambda: None)
        cast = torch.autocast(d.device.type, dtype=torch.bfloat16, enabled=gpu)

        def batch(mb: int, seq: int):
            g = torch.Generator(device=d.device).manual_seed(1000 * d.launch.rank + mb)
            ids = torch.randint(0, shape["vocabulary"], (mb, seq), generator=g, device=d.device)
            return ids, torch.randint(0, shape["vocabulary"], (mb, seq), generator=g, device=d.device)

        def event():
            if not gpu:
                return time.perf_counter()
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def span(a, b) -> float:
            return b - a if not gpu else a.elapsed_time(b) / 1e3

        micro = 2  # micro-batches a step (run 4's)

        def step(read: bool, inputs, clocks: list | None = None):
            opt.zero_grad(set_to_none=True)
            for ids, targets in inputs:
                if clocks is not None:
                    sync()
                    t0, e0 = time.perf_counter(), event()
                with cast:
                    loss = model(ids, targets)
                t1, e1 = time.perf_counter(), event()
                (loss / len(inputs)).backward()
                t2, e2 = time.perf_counter(), event()
                if clocks is not None:
                    sync()
                    clocks.append((t1 - t0, t2 - t1, span(e0, e1), span(e1, e2)))
            opt.step()
            if read:
                loss.item()

        res = {}
        for name, (mb, seq) in (("run 4", (shape["micro_batch"], shape["sequence"])),
                                ("host-bound", (1, min(512, shape["sequence"])))):
            inputs = [batch(mb, seq) for _ in range(micro)]
            clocks: list = []
            for i in range(STEPS):
                step(True, inputs, clocks if i >= WARMUP else None)
            med = [statistics.median(c[k] for c in clocks) for k in range(4)]
            res[name] = {"forward_issue_s": med[0], "backward_issue_s": med[1], "forward_device_s": med[2],
                         "backward_device_s": med[3], "forward_host_share": med[0] / (med[0] + med[1])}
        inputs = [batch(shape["micro_batch"], shape["sequence"]) for _ in range(micro)]
        for name, read in (("steps back to back", False), ("loss read each step", True)):
            sync()
            marks = [event()]
            for _ in range(STEPS):
                step(read, inputs)
                marks.append(event())
            sync()
            res[name] = {"step_s": statistics.median(span(a, b) for a, b in zip(marks[WARMUP:], marks[WARMUP + 1:]))}
        slowest = torch.tensor([res["steps back to back"]["step_s"], res["loss read each step"]["step_s"]],
                               device=d.device)
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        res["steps back to back"]["step_s"], res["loss read each step"]["step_s"] = slowest.tolist()
    finally:
        stop(d)
    if d.launch.rank == 0:
        from autotune.sbp.steptime import FORWARD_HOST_SHARE
        if profile and not small:  # the profile's host at the assumed and the measured share; the host measured here
            run4 = res["run 4"]
            share = run4["forward_host_share"]
            res["model"] = predicted(profile, world, {
                f"profile's host, share {FORWARD_HOST_SHARE:.2f} (assumed)": (FORWARD_HOST_SHARE, None),
                f"profile's host, share {share:.2f} (measured)": (share, None),
                "host as measured here": (share, run4["forward_issue_s"])})
        out.mkdir(parents=True, exist_ok=True)
        (out / "fsdp_prefetch.json").write_text(json.dumps({"world": world, "shape": shape, **res}, indent=1))
        print(table(res))


def table(res: dict) -> str:
    ms = lambda x: f"{x * 1e3:.2f}"  # noqa: E731
    lines = ["| micro-batch | forward issue ms | backward issue ms | forward share of host | forward device ms | "
             "backward device ms |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in ("run 4", "host-bound"):
        r = res[name]
        lines.append(f"| {name} | {ms(r['forward_issue_s'])} | {ms(r['backward_issue_s'])} | "
                     f"{r['forward_host_share']:.2f} | {ms(r['forward_device_s'])} | {ms(r['backward_device_s'])} |")
    lines += ["", "| loop | step ms (slowest rank, median) |", "| --- | ---: |"]
    lines += [f"| {name} | {ms(res[name]['step_s'])} |" for name in ("steps back to back", "loss read each step")]
    if res.get("model"):
        lines += ["", f"model, run 4's micro-batch from a lead of zero (measured forward on the device: "
                  f"{ms(res['run 4']['forward_device_s'])} ms)", "",
                  "| host | forward device ms | gathers exposed ms |", "| --- | ---: | ---: |"]
        lines += [f"| {name} | {ms(f)} | {ms(x)} |" for name, (f, x) in res["model"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    arg = (lambda flag: sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else None)  # noqa: E731
    main(Path(sys.argv[1]), "--small" in sys.argv, arg("--device") or "auto", arg("--profile"))
