"""Every plan kind of tests/gpu/apply_llama.py for N GPUs, on ONE GPU: each plan applied by ``autotune.apply``
and trained by execute's runner as rank 0 of torch's fake process group of N (every collective a no-op, so the
rank holds exactly the tensors it holds in the N-GPU job; DDP's buckets given a no-op communication hook, since
its reducer refuses the fake group's results), beside tensor parallelism composed by hand (torchtitan's way,
``apply_llama._hand_tp``). A rank's peak memory is then the N-GPU job's (Megatron t=4 under the fake group of 4,
60.61 GiB, as 4 x H200 measured it), so the memory model of every 4-GPU plan kind is checked without 4 GPUs. Not
the pipelined plans: torch's pipeline stages exchange their shapes as pickled objects, which a fake group cannot
carry. The step is the device's work and the host's without any communication: printed beside the prediction's
compute and its host pace, not judged (ours against the hand composition: the same work, the same run).

    python tests/gpu/plans_fake.py plan OUT PROFILE [--small] [--gpus N] [--sequence-parallel]  # apply_llama's
    # plans (CPU, ~1 min), or its Megatron plans without and with sequence parallelism
    [ONLY="TP t=2,hand t=2"] [STEPS=3] python tests/gpu/plans_fake.py all OUT [--device cuda|cpu]

Each plan runs in a process of its own and writes OUT/fake-<plan>.json; the table is printed last (predicted and
measured GiB, their error; the step without communication).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RUN_TIMEOUT_S = 240
STEPS, WARMUP = int(os.environ.get("STEPS", 3)), 1


def _noop_hook(state, bucket):
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _ddp_without_communication() -> None:
    """Every DistributedDataParallel made in this process reduces nothing (its buckets as they are)."""
    from torch.nn.parallel import DistributedDataParallel
    init = DistributedDataParallel.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_comm_hook(None, _noop_hook)
    DistributedDataParallel.__init__ = patched


def run_one(out: Path, name: str, device: str, rank: int = 0) -> None:
    """Plan ``name`` of OUT/plans.json as rank ``rank`` of a fake group of the plan's size: OUT/fake-<name>.json."""
    spec = json.loads((out / "plans.json").read_text())
    world = spec["world"]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autotune.execute.env import start
    from autotune.execute.pipetrain import run_pipeline_plan
    from autotune.execute.runner import run_module_plan
    from autotune.plan.typed import Plan
    _ddp_without_communication()
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    d = start(device)
    hand = name.startswith("hand t=")  # torchtitan's composition by hand (apply_llama._hand_tp)
    p = None if hand else Plan.from_dict(spec["plans"][name], name)
    row = {"name": name, "rank": rank, "world": world, "predicted": {} if hand else p.costs.to_dict()}
    try:
        if hand:
            rec = {"measured": _hand_run(spec["shape"], int(name[len("hand t="):]), d), "apply_path": "by hand"}
        else:
            runner = run_pipeline_plan if p.stages else run_module_plan
            rec, _ = runner(p, d, module="apply_llama:build", steps=STEPS, warmup=WARMUP, profile_steps=0,
                            dtype="auto")
        m = rec["measured"]
        peak = m.get("peak_memory_bytes")  # None on the CPU
        row.update(peak_gib=peak and peak[0] / 2**30, step_s=m.get("step_s"), path=rec.get("apply_path")
                   or "/".join((rec.get("pipeline") or {}).get("paths", [])))
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0][:160]}"
    finally:
        dist.destroy_process_group()
    (out / f"fake-{_slug(name)}.json").write_text(json.dumps(row, indent=1, default=str))


def _hand_run(shape: dict, t: int, d) -> dict:
    """Tensor parallelism at ``t`` composed by hand (torchtitan's way) trained by execute's trainer."""
    import torch

    import apply_llama
    from autotune.execute.moduletrain import ModuleTrainer
    model = apply_llama._hand_tp(shape, t, d)
    trainer = ModuleTrainer(model, {"kind": "llama", **shape}, shape["batch"] // shape["micro_batch"], d, 0, 1e-3,
                            torch.bfloat16 if d.is_gpu else None)
    try:
        return trainer.run(STEPS, WARMUP, 0)
    finally:
        trainer.close()


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def run_all(out: Path, device: str) -> int:
    spec = json.loads((out / "plans.json").read_text())
    rows, here = [], Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent.parent),
                                                        os.environ.get("PYTHONPATH", "")]))
    names = [k for k, p in spec["plans"].items() if not p.get("stages")] + [f"hand t={t}" for t, sp in spec["hand"]
                                                                             if not sp]
    only = [n.strip() for n in os.environ.get("ONLY", "").split(",") if n.strip()]
    for name in [n for n in names if not only or n in only]:
        print(f"[fake] {name}, rank 0 of {spec['world']}", flush=True)
        try:
            r = subprocess.run([sys.executable, __file__, "one", str(out), name, "--device", device], env=env,
                               timeout=RUN_TIMEOUT_S, capture_output=True, text=True)
            if r.returncode:
                print(r.stderr[-1500:], flush=True)
        except subprocess.TimeoutExpired:
            print(f"[fake] {name}: past {RUN_TIMEOUT_S} s, stopped", flush=True)
        f = out / f"fake-{_slug(name)}.json"
        rows.append(json.loads(f.read_text()) if f.exists() else {"name": name, "error": "no result"})
    (out / "plans_fake.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


def table(rows: list) -> str:
    lines = ["| plan | path | predicted GiB | measured GiB | error | predicted compute / host pace ms | "
             "measured ms (no communication) |", "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        p = r.get("predicted") or {}
        pred = p.get("memory_bytes", 0) / 2**30 if p.get("memory_bytes") else None
        got = r.get("peak_gib")
        err = f"{(pred - got) / got * 100:+.1f}%" if pred and got else "-"
        comp = "/".join("-" if p.get(k) is None else f"{p[k] * 1e3:.1f}" for k in ("compute_s", "host_step_s"))
        step = r.get("step_s")
        cells = [r["name"], r.get("error") or r.get("path") or "-",
                 "-" if pred is None else f"{pred:.2f}", "-" if got is None else f"{got:.2f}", err, comp,
                 "-" if not step else f"{step * 1e3:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    what, out = argv[0], Path(argv[1])
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cuda"
    if what == "plan":
        import apply_llama
        gpus = int(argv[argv.index("--gpus") + 1]) if "--gpus" in argv else 4
        apply_llama.plan(out, argv[2], "--small" in argv, gpus, "--sequence-parallel" in argv)
        spec = json.loads((out / "plans.json").read_text())
        (out / "plans.json").write_text(json.dumps(dict(spec, world=gpus)))
        return 0
    if what == "one":
        run_one(out, argv[2], device)
        return 0
    return run_all(out, device)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
