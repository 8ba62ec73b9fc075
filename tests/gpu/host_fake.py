"""The host's cost of the multi-GPU apply paths measured on ONE GPU: ``calibrate.modulehost.host_seconds`` of
ddp, fully_shard, tensor and dtensor for transformers' LlamaForCausalLM 1.5 B (plans_h200x2.md's model) under
torch's fake process group of 2 (every collective a no-op: the host's work of a group of 2, DTensor's sharding
and dispatch at width 2, without the device's communication), beside the NCCL group of one that calibrate module
uses on one GPU. Compared with the 2-GPU steps of plans_h200x2.md run 4 (Megatron t=2: 717.8 ms, host issue
732.7 ms; DDP 378.1; FSDP 425.0), 2 micro-batches x 16 blocks.

    timeout 400 python3 tests/gpu/host_fake.py      # nvidia-h200, ~3 min; writes $OUT/host_fake.json
    WORLDS=2 MBS=2 PATHS="none tensor sequence" python3 tests/gpu/host_fake.py   # a part of it
    MODELS="reference llama1.5b" REPEAT=3 ...   # calibrate compute's reference block (micro-batch 1 of 512 tokens)
                                                # beside the 1.5 B model's, each measured REPEAT times in turn
"""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from calibrate.modulehost import PEER_HOST_PATHS, REFERENCE_HF, host_seconds
from calibrate.usermodule import hf_module

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 16,
          "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 2048,
          "tie_word_embeddings": False}
MEASURED_2GPU_MS = {"tensor": 717.8, "ddp": 378.1, "fully_shard": 425.0}  # plans_h200x2.md run 4, slowest rank


def main() -> int:
    out = os.environ.get("OUT", "/tmp/gpu-out")
    os.makedirs(out, exist_ok=True)
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    models = {"llama1.5b": (hf_module(CONFIG, "llama1.5b"), 2048), "reference": (hf_module(REFERENCE_HF, "ref"), 512)}
    names = os.environ.get("MODELS", "llama1.5b").split()
    rows = {}
    worlds = [int(x) for x in os.environ.get("WORLDS", "1 2").split()]
    mbs = [int(x) for x in os.environ.get("MBS", "1 2").split()]
    paths = tuple(os.environ.get("PATHS", " ".join(PEER_HOST_PATHS)).split())
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            if world == 1:
                dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0,
                                        world_size=1, device_id=device)
            else:
                from torch.testing._internal.distributed.fake_pg import FakeStore
                dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
            try:
                for rep in range(int(os.environ.get("REPEAT", 1))):
                    for name in names:
                        um, sequence = models[name]
                        for mb in mbs if name != "reference" else (1,):
                            key = (f"world{world}-mb{mb}" + (f"-{name}" if len(names) > 1 else "")
                                   + f"-{rep}" * (rep > 0))
                            rows[key] = host_seconds(torch, um, mb, sequence, device, int(os.environ.get("ITERS", 6)),
                                                     2, lambda s: print(f"{key}: {s}", flush=True), paths, outside={})
            finally:
                dist.destroy_process_group()
    with open(os.path.join(out, "host_fake.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print("| group | micro-batch | path | ms per block and micro-batch | 32 x it (2 x 16) ms | 2-GPU step measured ms |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for key, got in rows.items():
        world, mb = key.split("-")[:2]
        for path, (h, _) in got.items():
            print(f"| {key} | {mb[2:]} | {path} | {h * 1e3:.2f} | {32 * h * 1e3:.1f} | "
                  f"{MEASURED_2GPU_MS.get(path, '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
