"""The caching allocator's fragmentation at a training step's peak, for the profiles' ``memory_fragmentation``
(issue 43): reserved minus allocated at the peak, as a share of what the step reserved, on transformers'
LlamaForCausalLM and GPT2LMHeadModel trained as users train them (bf16 autocast, fused AdamW, gradient
accumulation over micro-batches, with and without activation checkpointing).

    timeout 900 python3 tests/gpu/fragmentation.py        # one GPU; writes $OUT/fragmentation.json

About 2 minutes on one H100/H200. The table printed last: per model and setting, peak allocated, peak reserved
and their gap; the profile figure is the largest gap share (``fraction``).
"""
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


def run(name, make, seq, mbs, checkpoint):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = make().cuda()
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
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    alloc, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    del model, opt
    return {"model": name, "sequence": seq, "micro_batch": mbs, "checkpoint": checkpoint,
            "peak_allocated": alloc, "peak_reserved": reserved, "gap_share": (reserved - alloc) / reserved}


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
            try:
                rows.append(run(name, make, seq, mbs, ckpt))
            except torch.OutOfMemoryError as e:
                rows.append({"model": name, "checkpoint": ckpt, "error": str(e)[:200]})
            print(rows[-1], flush=True)
    good = [r for r in rows if "gap_share" in r]
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds": time.time() - t0,
              "rows": rows, "fraction": max((r["gap_share"] for r in good), default=None)}
    with open(os.path.join(out, "fragmentation.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"{'model':<16} {'ckpt':<5} {'allocated GiB':>14} {'reserved GiB':>13} {'gap':>6}")
    for r in good:
        print(f"{r['model']:<16} {str(r['checkpoint']):<5} {r['peak_allocated'] / 2**30:>14.2f} "
              f"{r['peak_reserved'] / 2**30:>13.2f} {r['gap_share']:>6.1%}")
    print(f"fraction for the profile: {record['fraction']}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
