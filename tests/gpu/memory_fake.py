"""Where a tensor-parallel step's memory goes, on ONE GPU: the Megatron t=2 plan of tests/gpu/apply_llama.py
(transformers' LlamaForCausalLM 1.5 B, batch 16 in 2 micro-batches, sequence 2048: plans_h200x2.md run 4, where
2 x H200 measured 54.08 GiB against 45.70 predicted) applied by ``autotune.apply`` and trained by execute's
runner as rank 0 of torch's fake process group of 2 (every collective a no-op; the tensors each rank holds are
the same), with the allocator's history recorded: the peak, and the live blocks at the peak grouped by where
they were allocated.

With ``ddp``: run 4's data-parallel step as one of its ranks holds it (a local batch of 8 in 2 micro-batches of
4, the first under ``no_sync``), ``DistributedDataParallel`` as apply wraps it, on an NCCL group of one (DDP refuses
the fake group): 2 x H200 measured 62.62 GiB against 57.35 predicted.

    OUT=$OUT timeout 400 python3 tests/gpu/memory_fake.py [tensor|ddp]     # nvidia-h200, ~1 min each
"""
import collections
import json
import os
import sys
from pathlib import Path

MODE = sys.argv[1] if len(sys.argv) > 1 else "tensor"
if MODE == "tensor":  # rank 0 of 2, as execute's launcher sees it
    os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import apply_llama  # noqa: E402  (tests/gpu on the path)
from alloc_trace import peak_live, site  # noqa: E402

PROFILE = "reports/records/plans-h200x2-2026-11-28/profile-h200x2-run4.json"
def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.set_device(0)
    from autotune.execute.env import start, stop
    shape = dict(apply_llama.SHAPE, batch=16, micro_batch=8)
    if MODE == "tensor":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        plan = apply_llama._megatron(shape, PROFILE, (1, 1), (1, 2), "Megatron d=1 t=2", 2)
    else:
        plan = apply_llama._megatron(shape, PROFILE, (1, 2), (1, 1), "data parallel d=2", 2)
    d = start("cuda")
    torch.cuda.memory._record_memory_history(max_entries=400_000)
    try:
        if MODE == "tensor":
            from autotune.execute.runner import run_module_plan
            rec, model = run_module_plan(plan, d, module="apply_llama:build", steps=2, warmup=1, profile_steps=0)
        else:  # one rank's piece of run 4's data-parallel step
            from torch.nn.parallel import DistributedDataParallel
            from autotune.execute.moduletrain import ModuleTrainer
            local = dict(shape, batch=8, micro_batch=4)
            model = apply_llama.build({"kind": "llama", **local}).to(d.device)
            ddp = DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=True)
            trainer = ModuleTrainer(ddp, {"kind": "llama", **local}, 2, d, 0, 1e-3, torch.bfloat16)
            try:
                rec = {"measured": trainer.run(2, 1, 0)}
            finally:
                trainer.close()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        stop(d)
    best, _, sites = peak_live(snap, 0, site)
    by = collections.Counter({k: v[0] for k, v in sites.items()})
    m = rec["measured"]
    result = {"predicted_gib": plan.costs.memory_bytes / 2**30,
              "predicted_parts_gib": {k: v / 2**30 for k, v in plan.costs.memory.items() if isinstance(v, (int, float))},
              "peak_gib": max(m["peak_memory_bytes"]) / 2**30, "phases_gib": {k: v / 2**30 for k, v in
                                                                             (m.get("peak_memory_phases_bytes") or {}).items()},
              "trace_peak_gib": best / 2**30, "at_peak_gib": {k: v / 2**30 for k, v in by.most_common(40)}}
    (out / f"memory_fake_{MODE}.json").write_text(json.dumps(result, indent=1))
    print(f"predicted {result['predicted_gib']:.2f} GiB {json.dumps({k: round(v, 2) for k, v in result['predicted_parts_gib'].items()})}")
    print(f"measured under the fake group: peak {result['peak_gib']:.2f} GiB, phases "
          f"{json.dumps({k: round(v, 2) for k, v in result['phases_gib'].items()})}; trace peak {best / 2**30:.2f}")
    print("| allocated at | GiB live at the peak |")
    print("| --- | ---: |")
    for k, v in by.most_common(40):
        print(f"| {k} | {v / 2**30:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
