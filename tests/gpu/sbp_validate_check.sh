#!/usr/bin/env bash
# SBP validation on the GPU machine (2 x H200 on NVLink): replays >= 8 plans of a
# GPT layer through the nccl backend and prints measured vs predicted with the
# Spearman rank correlation; writes $OUT/sbp/validate.json and validate.txt.
# Run from the repository root:  OUT=/path bash tests/gpu/sbp_validate_check.sh
# Predictions use the embedded default profile (calibrate.profile.DEFAULT_PROFILE);
# pass another with PROFILE=name.
set -euo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-${1:-out}}
mkdir -p "$OUT/sbp"
PROFILE_ARGS=()
if [ -n "${PROFILE:-}" ]; then PROFILE_ARGS=(--profile "$PROFILE"); fi
mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE python3 -m autotune validate \
  --backend nccl --nodes 1 --gpus-per-node 2 --plans 10 --mode graph --dtype float16 \
  --hidden 4096 --heads 32 --sequence 2048 --batch 8 --micro-batch 8 --vocabulary 51200 \
  --iters 20 --warmup 5 "${PROFILE_ARGS[@]}" --out "$OUT/sbp" | tee "$OUT/sbp/validate.txt"
