#!/usr/bin/env bash
# How long `python -m calibrate module` takes at its default shapes (tensor widths that divide the model, micro-batches
# 1,2,4, sequence 2048, the host's cost on a group of one) for a 1.5 B and an 8 B transformers Llama on one GPU
# (issue 42: at most 3 minutes for a 1-8 B model). nvidia-h200, ~6-9 min. Results under $OUT, a table last.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; PY=${PY:-python3}; mkdir -p "$OUT"
PROFILE=${PROFILE:-reports/records/plans-h200x4-2026-11-28/profile-h200x4-measured.json}
$PY tests/gpu/hf_configs.py "$OUT" 2048
rows=()
for m in ${MODELS:-llama1.5b llama8b}; do
  t0=$SECONDS
  timeout "${MODULE_TIMEOUT:-290}" $PY -m calibrate module --model "$OUT/$m.json" --profile "$PROFILE" \
    --out "$OUT/$m-profile.json" ${ARGS:-} > "$OUT/$m.log" 2>&1
  rc=$?
  rows+=("| $m | $rc | $((SECONDS - t0)) | $(grep -c 'tensor .*micro-batch' "$OUT/$m.log") |")
  tail -2 "$OUT/$m.log"
done
echo "| model | exit | seconds | shapes timed |"; echo "| --- | ---: | ---: | ---: |"
printf '%s\n' "${rows[@]}"
