"""The caching allocator's fragmentation at a training step's peak, for the profiles' ``memory_fragmentation``
(issue 43), on transformers' LlamaForCausalLM and GPT2LMHeadModel trained as users train them (bf16 autocast,
fused AdamW, gradient accumulation over micro-batches, with and without activation checkpointing). Two figures
per model and setting:

- the gap unconstrained: reserved minus allocated at the peak, as a share of what the step reserved (the
  allocator keeps what it cached: an upper bound on what is lost at the limit);
- the allowance needed: the smallest cap on the allocator (``torch.cuda.set_per_process_memory_fraction``,
  bisected between the peak allocated and the peak reserved, the step re-run from a fresh model at each cap)
  at which the step still runs, less the peak allocated, as a share of that cap. Under a cap the allocator
  frees its cache and retries before it fails, so this is what a plan near the limit loses.

    timeout 900 python3 tests/gpu/fragmentation.py        # one GPU; writes $OUT/fragmentation.json

About 4 minutes on one H200. The table printed last; the profile figure is the largest allowance needed
(``fraction``).
"""
import gc
import json
import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

STEPS = 4
MICRO_BATCHES = 4


def models():
    yield "llama-1.3b-ish", lambda: LlamaForCausalLM(LlamaConfig(
        hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096)), 4096, 4
    yield "gpt2-large", lambda: GPT2LMHeadModel(GPT2Config(n_embd=1280, n_layer=36, n_head=20,
                                                           n_positions=1024)), 1024, 8


BISECTIONS = 6  # the cap found to within (peak reserved - peak allocated) / 64


def run(make, seq, mbs, checkpoint, cap=None):
    """(peak allocated, peak reserved) of ``STEPS`` steps from a fresh model, under ``cap`` bytes (None: no cap);
    None where the step runs out of memory under the cap."""
    total = torch.cuda.get_device_properties(0).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else cap / total)
    torch.cuda.reset_peak_memory_stats()
    model = opt = None
    try:
        with torch.device("cuda"):
            model = make()
        if checkpoint:
            model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        vocab = model.config.vocab_size
        for _ in range(STEPS):
            for _ in range(MICRO_BATCHES):
                ids = torch.randint(0, vocab, (mbs, seq), device="cuda")
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss / MICRO_BATCHES
                loss.backward()
                del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    except torch.OutOfMemoryError:
        return None
    finally:
        del model, opt
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)


def measure(name, make, seq, mbs, checkpoint):
    alloc, reserved = run(make, seq, mbs, checkpoint)
    lo, hi = alloc, reserved  # lo: assumed too little (nothing below the peak allocated runs), hi: runs
    for _ in range(BISECTIONS):
        mid = (lo + hi) // 2
        if run(make, seq, mbs, checkpoint, mid) is None:
            lo = mid
        else:
            hi = mid
    return {"model": name, "sequence": seq, "micro_batch": mbs, "checkpoint": checkpoint,
            "peak_allocated": alloc, "peak_reserved": reserved, "gap_share": (reserved - alloc) / reserved,
            "cap_needed": hi, "allowance_needed": (hi - alloc) / hi}


def main() -> int:
    if not torch.cuda.is_available():
        print("fragmentation: no GPU here")
        return 1
    out = os.environ.get("OUT", "/tmp/gpu-out")
    os.makedirs(out, exist_ok=True)
    rows = []
    t0 = time.time()
    for name, make, seq, mbs in models():
        for ckpt in (False, True):
            rows.append(measure(name, make, seq, mbs, ckpt))
            print(rows[-1], flush=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds": time.time() - t0,
              "rows": rows, "fraction": max(r["allowance_needed"] for r in rows)}
    with open(os.path.join(out, "fragmentation.json"), "w") as f:
        json.dump(record, f, indent=1)
    print("| model | checkpoint | allocated GiB | reserved GiB | gap | cap needed GiB | allowance needed |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['checkpoint']} | {r['peak_allocated'] / 2**30:.2f} | "
              f"{r['peak_reserved'] / 2**30:.2f} | {r['gap_share']:.1%} | {r['cap_needed'] / 2**30:.2f} | "
              f"{r['allowance_needed']:.1%} |")
    print(f"fraction for the profile (the largest allowance needed): {record['fraction']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
