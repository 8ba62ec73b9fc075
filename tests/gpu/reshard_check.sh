#!/usr/bin/env bash
# GPU check of the cross-mesh resharding executor (NCCL backend), one process per GPU, on
# nvidia-h200-x2: what two GPUs on one host allow, every strategy planned with the ensemble
# solver on the default profile, each plan run 1 + 5 times (median of the 5), every destination
# tile checked exactly. Writes $OUT/reshard_gpu.json (kind "reshard", rows under "executed").
#   OUT=/path bash tests/gpu/reshard_check.sh      (from the repository root)
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-${1:-out}}
mkdir -p "$OUT"
PY=${PY:-python3}
MIB=${MIB:-64}   # tensor of MIB MiB (float32): (MIB, 1024, 256)
scenarios=(
  "RRR@1,1[0]:RRR@1,1[1]"      # device 0 -> device 1, the whole tensor
  "S1RR@1,2:S1RR@1,2[1,0]"     # the two halves swap devices
  "S1RR@1,2:RS1R@1,2+shared"   # each device keeps a quarter, swaps a quarter
  "S1RR@1,2:RRR@1,2+shared"    # all-gather-like: each device needs the other's half
  "RRR@1,1[1]:RRR@1,2[0,1]"    # device 1 -> devices 0 and 1 (a broadcast)
  "RRR@1,1[0]:S1RR@1,2[0,1]"   # device 0 scatters halves to devices 0 and 1
)
args=()
for s in "${scenarios[@]}"; do args+=(--scenario "$s"); done
timeout 300 mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x PYTHONPATH $PY -m autotune reshard \
  --execute nccl --shape "$MIB,1024,256" --devices-per-host 2 --solvers ensemble --time-budget 0.2 \
  --iters 5 "${args[@]}" --results "$OUT/reshard_gpu.json"
