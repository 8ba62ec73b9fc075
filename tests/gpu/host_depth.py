"""Where the tensor path's host time goes in the step users run (issue 42): the Megatron t=2 plan of
plans_h200x2.md's transformers Llama (2048 wide, ffn 8192, vocabulary 128256, sequence 2048, micro-batches of 8
sequences, each whole on both ranks) at 2 and 16 blocks and 1 or 2 micro-batches, without and with sequence
parallelism, each run through autotune.apply by execute's runner (apply_llama.run), its host issue time beside
the step model's host pace. The slope over the blocks is the host's cost of a block in place, the rest the
model's outside the blocks (embedding, rotary tables, mask, head, vocabulary-parallel loss, optimizer).

    python tests/gpu/host_depth.py OUT PROFILE [--small]   # writes OUT/plans.json (CPU), then:
    torchrun --nproc-per-node 2 tests/gpu/apply_llama.py run OUT
"""
import json
import sys
from pathlib import Path

from apply_llama import SHAPE, SMALL, _megatron

RUNS = [(2, 2, False), (16, 2, False), (2, 1, False), (16, 1, False), (2, 2, True), (16, 2, True)]  # (blocks, m, SP)


def main(out: Path, profile: str, small: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    base = dict(SMALL if small else SHAPE)
    mb = base["micro_batch"] // 2 if small else 8  # as apply_check's Megatron t=2 on 2 GPUs
    plans = {}
    for layers, m, sp in RUNS:
        shape = dict(base, layers=layers, micro_batch=mb, batch=mb * m)
        name = f"TP{' SP' * sp} L={layers} m={m}"
        plans[name] = _megatron(shape, profile, (1, 1), (1, 2), f"Megatron d=1 t=2{', sequence parallel' * sp}",
                                2, sp).to_dict()
    (out / "plans.json").write_text(json.dumps({"shape": base, "plans": plans, "hand": []}))
    print(f"wrote {out / 'plans.json'}: {', '.join(plans)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], "--small" in sys.argv)
