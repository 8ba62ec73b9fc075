#!/usr/bin/env bash
# The user's flow with every default (issue 42), on the GPUs visible (nvidia-h200-x2 or x4): a config.json as
# transformers saves it (max_position_embeddings 8192), `calibrate module` with no shape flags, then
# `torchrun -m autotune tune --model config.json` with no search options and no --module. Models: MODELS (llama8b:
# Llama 3 8B's shape, calibrate module only, timed against issue 42's 3 minutes; llama1.5b: calibrate module and
# tune). PROFILE: the profile with the collectives, host and overlap figures of this kind of machine. Results under
# $OUT, a table last.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/defaults}; PY=${PY:-python3}; mkdir -p "$OUT"
PROFILE=${PROFILE:?give PROFILE=a profile.json of this machine kind with collectives, host and overlap figures}
NGPU=${NGPU:-$($PY -c "import torch; print(torch.cuda.device_count())")}
$PY tests/gpu/hf_configs.py "$OUT" 8192
rows=()
for m in ${MODELS:-llama8b llama1.5b}; do
  t0=$SECONDS
  timeout "${MODULE_TIMEOUT:-280}" $PY -m calibrate module --model "$OUT/$m.json" --profile "$PROFILE" \
    --out "$OUT/$m-profile.json" > "$OUT/$m-module.log" 2>&1
  rc=$?; rows+=("| $m | calibrate module | $rc | $((SECONDS - t0)) |"); tail -2 "$OUT/$m-module.log"
  [ "$m" = llama8b ] && continue
  t0=$SECONDS
  timeout "${TUNE_TIMEOUT:-300}" torchrun --nproc-per-node "$NGPU" -m autotune tune --model "$OUT/$m.json" \
    --profile "$OUT/$m-profile.json" --out "$OUT/$m-tune" > "$OUT/$m-tune.log" 2>&1
  rc=$?; rows+=("| $m | autotune tune | $rc | $((SECONDS - t0)) |")
  grep -E "^model |^\[tune\] [0-9]+ candidates" "$OUT/$m-tune.log" | tail -2
  [ -f "$OUT/$m-tune/tune.md" ] && cat "$OUT/$m-tune/tune.md"
done
echo "| model | step | exit | seconds |"; echo "| --- | --- | ---: | ---: |"
printf '%s\n' "${rows[@]}"
