#!/usr/bin/env bash
# Issues 41/43 on 2 GPUs (nvidia-h200-x2, about 3 minutes): Megatron's tensor parallelism at t = 2 (and 4 on 4
# GPUs) without and with sequence parallelism, each plan run through autotune.apply (the tensor path) beside the
# same composed by hand with torch's ParallelStyles (torchtitan's way) in one torchrun job, on transformers'
# LlamaForCausalLM of 1.5 B (tests/gpu/apply_llama.py's shape: batch 16 in 2 micro-batches of 8 x 2048 on 2 GPUs).
# The table last (predicted and measured step, memory); $OUT/apply_check.json holds the records.
#   run(command="PARTS=seqpar bash tests/gpu/run_all.sh", kind="nvidia-h200-x2")
#   or run(command="OUT=\$OUT/sp bash tests/gpu/seqpar_check.sh", kind="nvidia-h200-x2")
# On CPUs (the logic): DEVICE=cpu NGPU=2 SMALL=--small bash tests/gpu/seqpar_check.sh
NGPU=${NGPU:-2} PROFILE=${PROFILE:-reports/records/plans-h200x2-2026-11-28/profile-h200x2-run4.json} \
  RUN_TIMEOUT=${RUN_TIMEOUT:-360} PLAN_ARGS=--sequence-parallel exec bash "$(dirname "$0")/apply_check.sh"
