"""DDP's gradient buckets across its first steps, on ONE GPU (issue 42 item 4: DDP's buckets and first-step transient):
run 4's data-parallel step as one rank holds it (plans_h200x2.md: transformers' LlamaForCausalLM 1.5 B, a local batch
of 8 in 2 micro-batches of 4, the first under ``no_sync``) in ``DistributedDataParallel`` as ``autotune.apply`` wraps
it, on an NCCL group of one, in variants that each run in a fresh process:

- ``apply``: as apply wraps it (``gradient_as_bucket_view=True``), execute's trainer (``zero_grad(set_to_none=True)``);
- ``gc``: the same, with ``gc.collect()`` at every forward (after DDP's pre-forward, where it rebuilds its buckets);
- ``nogc``: the same with Python's cyclic collector off;
- ``one``: one micro-batch of 4 a step (no accumulation);
- ``copy``: ``gradient_as_bucket_view=False``.

Per step: the peak allocated, and the allocated bytes at each forward's start (after DDP's pre-forward); the gradients'
bytes for scale. A bucket set alive beside another shows as a step of one gradient copy.

    OUT=$OUT timeout 420 python3 tests/gpu/ddp_buckets.py [VARIANT ...]     # nvidia-h200, ~1 min a variant
"""
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = ("apply", "gc", "nogc", "one", "copy")
STEPS = 3


def variant(name: str) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import apply_llama
    from autotune.execute.env import start, stop
    from autotune.execute.moduletrain import ModuleTrainer

    if name == "nogc":
        gc.disable()
    micro = 1 if name == "one" else 2
    local = dict(apply_llama.SHAPE, batch=4 * micro, micro_batch=4)
    d = start("cuda")
    try:
        model = apply_llama.build({"kind": "llama", **local}).to(d.device)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        before = torch.cuda.memory_allocated()
        ddp = DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=name != "copy")
        wrapped = torch.cuda.memory_allocated() - before
        at_forward: list = []

        def hook(_module, _args):
            if name == "gc":
                gc.collect()
            at_forward.append(torch.cuda.memory_allocated() / 2**30)

        model.register_forward_pre_hook(hook)
        trainer = ModuleTrainer(ddp, {"kind": "llama", **local}, micro, d, 0, 1e-3, torch.bfloat16)
        steps = []
        for s in range(STEPS):
            torch.cuda.reset_peak_memory_stats()
            at_forward.clear()
            start_alloc = torch.cuda.memory_allocated() / 2**30
            float(trainer.step(s))
            torch.cuda.synchronize()
            steps.append({"start_gib": start_alloc, "at_forward_gib": list(at_forward),
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                          "end_gib": torch.cuda.memory_allocated() / 2**30})
        trainer.close()
        return {"variant": name, "gradients_gib": params / 2**30, "wrap_gib": wrapped / 2**30, "steps": steps}
    finally:
        stop(d)


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print("RESULT " + json.dumps(variant(sys.argv[2])), flush=True)
        return 0
    names = sys.argv[1:] or VARIANTS
    results = []
    for name in names:
        try:
            r = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=150)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            results.append(json.loads(line[-1][7:]) if line else {"variant": name, "error": r.stderr[-600:]})
        except subprocess.TimeoutExpired:
            results.append({"variant": name, "error": "timed out after 150 s"})
        (out / "ddp_buckets.json").write_text(json.dumps(results, indent=1))
    print("| variant | gradients GiB | wrap GiB | step: start / at each forward / peak / end GiB |")
    print("| --- | ---: | ---: | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['variant']} | error: {r['error'].splitlines()[-1] if r['error'] else '?'} | | |")
            continue
        steps = "; ".join(f"{s['start_gib']:.2f} / {', '.join(f'{x:.2f}' for x in s['at_forward_gib'])} / "
                          f"**{s['peak_gib']:.2f}** / {s['end_gib']:.2f}" for s in r["steps"])
        print(f"| {r['variant']} | {r['gradients_gib']:.2f} | {r['wrap_gib']:.2f} | {steps} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
