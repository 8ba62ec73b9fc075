"""What full recomputation costs a block of the user's transformers model on one GPU, as apply runs it and as
transformers' own gradient checkpointing runs it (issue 42: plans that recompute ran 2-7% slower than priced on
2 x H200, where ``calibrate module``'s figure is the second).

    python3 tests/gpu/recompute_check.py CONFIG.json [MICRO_BATCH [SEQUENCE]]     # defaults 4, 4096

Per block (a model of 4 blocks less one of 1, over 3; fp32 weights, bf16 autocast, gradients from none): the
forward, the backward, and what a forward and backward under recomputation add (``hf``: transformers'
``gradient_checkpointing_enable``; ``apply``: ``autotune.apply.layers._rerun`` on every block; ``noearly``: apply's
without torch's early stop), then the same with two micro-batches accumulated; medians of 7 rounds, the arms
interleaved; last, the matmuls each arm launches in a 1-block model (the profiler's count)."""
import functools
import json
import statistics
import sys

import torch
from torch.utils.checkpoint import set_checkpoint_early_stop
from transformers import AutoConfig, AutoModelForCausalLM

from autotune.apply.layers import _cache_slots, _rerun

ARMS = ("f", "fb", "hf", "apply", "noearly", "fb2", "hf2", "apply2")
ROUNDS, MORE = 7, 3


def build(config: dict, blocks: int, device):
    cfg = AutoConfig.for_model(**dict(config, num_hidden_layers=blocks, n_layer=blocks))
    with device:
        return AutoModelForCausalLM.from_config(cfg).float().train()


def arm(model, how: str, ids):
    """One arm: ``how`` less a trailing "2" (two micro-batches accumulated)."""
    n, how = (2, how[:-1]) if how.endswith("2") else (1, how)
    layers = model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h

    def loss():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids).loss

    def run():
        for p in model.parameters():
            p.grad = None
        if how == "f":
            loss()
            return
        saved = [layer.forward for layer in layers]
        if how == "hf":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif how in ("apply", "noearly"):
            for layer in layers:
                layer.forward = functools.partial(_rerun, layer.forward, _cache_slots(layer.forward))
        try:
            with set_checkpoint_early_stop(how != "noearly"):
                for _ in range(n):
                    loss().backward()
        finally:
            if how == "hf":
                model.gradient_checkpointing_disable()
            for layer, f in zip(layers, saved):
                layer.forward = f
    return run


def main(path: str, micro_batch: int = 4, sequence: int = 4096) -> None:
    dev = torch.device("cuda")
    with open(path) as f:
        config = json.load(f)
    ids = torch.randint(0, config.get("vocab_size", 32000), (micro_batch, sequence), device=dev)
    models = {n: build(config, n, dev) for n in (1, 1 + MORE)}
    runs = {(n, a): arm(m, a, ids) for n, m in models.items() for a in ARMS}
    for r in runs.values():
        r()
    times = {k: [] for k in runs}
    for _ in range(ROUNDS):
        for k, r in runs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            r()
            b.record()
            torch.cuda.synchronize()
            times[k].append(a.elapsed_time(b))
    med = {k: statistics.median(v) for k, v in times.items()}
    blk = {a: (med[(1 + MORE, a)] - med[(1, a)]) / MORE for a in ARMS}
    print(f"{torch.cuda.get_device_name()}, {config.get('architectures', ['?'])[0]}, micro-batch {micro_batch}, "
          f"sequence {sequence}; ms per block")
    print("| forward | backward | + recompute (hf) | (apply) | (apply, no early stop) | 2 micro-batches: "
          "backward and accumulation | + recompute (hf) | (apply) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {blk['f']:.2f} | {blk['fb'] - blk['f']:.2f} | {blk['hf'] - blk['fb']:.2f} | "
          f"{blk['apply'] - blk['fb']:.2f} | {blk['noearly'] - blk['fb']:.2f} | {blk['fb2'] - 2 * blk['f']:.2f} | "
          f"{blk['hf2'] - blk['fb2']:.2f} | {blk['apply2'] - blk['fb2']:.2f} |")
    from torch.profiler import ProfilerActivity, profile
    for a in ("fb", "hf", "apply", "noearly"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runs[(1, a)]()
            torch.cuda.synchronize()
        mm = sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
        print(f"1-block model, {a}: {mm} matmuls")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
