"""How long ``autotune.apply`` takes on a Llama-70B-shaped model (80 layers, hidden 8192, 64 heads, 8 KV
heads, ffn 28672, vocabulary 128256) built on the meta device (no memory, no arithmetic):

    PYTHONPATH=$PWD python tests/bench/apply_meta.py            # both cases, a table
    PYTHONPATH=$PWD python tests/bench/apply_meta.py --layers 8 # a smaller stack

Two cases, each in a fresh process after the model is built (building it is not timed):

- ``world 1``: a 1 x 1 plan with full recomputation; apply finds the 80 x 9 modules by pattern, checks
  every parameter's shape against the plan's model and wraps each block in checkpoint (no placement:
  one device).
- ``fake world N``: a 1 x N plan (data x tensor parallel + FSDP over the data axis) in a one-process
  "fake" process group of N ranks (torch's testing FakeStore: collectives return at once), so that apply
  does everything it does on a real cluster: the mesh, every parameter made a DTensor (``distribute_tensor``
  of a meta tensor: shapes and placements, no data moves), the FSDP parametrizations, the gradient hooks
  and the activation hooks. What it does not measure: the data a real scatter of the weights moves.

With ``--world 4`` the plan (data 2 x tensor parallel 2, FSDP over the data axis) is a TP + FSDP baseline
that apply places through ``parallelize_module`` and ``fully_shard`` (``placement_path``); with 8 (two
tensor-parallel axes) through DTensor placements and FSDP parametrizations.

The target (issue 27): under 10 s for the 80-layer model. Seconds are the process's CPU time and wall time
of the apply call alone (imports and building the model excluded).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMA_70B = dict(kind="llama", layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672,
                 sequence=4096, vocabulary=128256, batch=8, micro_batch=1)


def one(layers: int, world: int) -> tuple[float, float]:
    """apply's (CPU, wall) seconds in this process for a ``world``-device plan."""
    sys.path.insert(0, str(HERE.parent / "autotune"))
    import torch
    import torch.distributed as dist
    from apply_plans import data_parallel, tp_data, typed_plan
    from transformers import LlamaConfig, LlamaForCausalLM

    import autotune
    c = dict(LLAMA_70B, layers=layers)
    cfg = LlamaConfig(vocab_size=c["vocabulary"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
                      num_hidden_layers=layers, num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                      max_position_embeddings=c["sequence"])
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if world == 1:
        plan = typed_plan(c, 1, 1, data_parallel(c, axes=1), "one device", recompute="full")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        axes = world.bit_length() - 1
        plan = typed_plan(c, 1, world, tp_data(c, axes=axes, tp=axes - 1), "TP + FSDP", recompute="full",
                          fsdp_axes=(0,))
    c0, t0 = time.process_time(), time.perf_counter()
    autotune.apply(plan, model)
    return time.process_time() - c0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--world", type=int, default=8, help="ranks of the fake process group (a power of 2)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # run one case in this process
    args = ap.parse_args()
    if args.one is not None:
        print("%.3f %.3f" % one(args.layers, args.one))
        return
    print(f"{'case':<24} {'layers':>6} {'CPU s':>7} {'wall s':>7}")
    for world in (1, args.world):
        out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--one", str(world)],
                             capture_output=True, text=True, env=dict(os.environ))
        if out.returncode:
            sys.exit(out.stderr.strip().splitlines()[-1])
        name = "world 1" if world == 1 else f"fake world {world} (1 x {world})"
        cpu, wall = (float(x) for x in out.stdout.split()[-2:])
        print(f"{name:<24} {args.layers:>6} {cpu:>7.2f} {wall:>7.2f}")


if __name__ == "__main__":
    main()
