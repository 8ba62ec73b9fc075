#!/usr/bin/env bash
# A pipelined plan's step, predicted beside measured (issue 42), on the GPUs visible: for each "NAME SEQUENCE BATCH"
# of CASES (';'-separated; NAME a config of tests/gpu/hf_configs.py), `calibrate module` of transformers' class at
# that sequence (tensor width 1: a stage per GPU; MODULE=0: the module section of PROFILE kept), the search with
# --pipeline NGPU, then `torchrun -m autotune execute` of its pipelined plan (best or baseline) on transformers'
# class, and tests/gpu/pipe_time.py (each rank's actions; PIPE_TIME=0: not).
# PROFILE: a profile of this machine kind with collectives, host and overlap figures. Results under $OUT, a table last.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/pipestep}; PY=${PY:-python3}; mkdir -p "$OUT"
PROFILE=${PROFILE:?give PROFILE=a profile.json of this machine kind with collectives, host and overlap figures}
NGPU=${NGPU:-$($PY -c "import torch; print(torch.cuda.device_count())")}
$PY tests/gpu/hf_configs.py "$OUT" 8192
IFS=';' read -ra cases <<< "${CASES:-qwen1.5b 2048 32;mistral16 2048 16}"
rows=()
for c in "${cases[@]}"; do
  read -r m seq batch <<< "$c"
  prof=$PROFILE
  if [ "${MODULE:-1}" = 1 ]; then
    t0=$SECONDS; prof=$OUT/$m-profile.json
    timeout "${MODULE_TIMEOUT:-200}" $PY -m calibrate module --model "$OUT/$m.json" --profile "$PROFILE" --tensor 1 \
      --sequence "$seq" --out "$prof" > "$OUT/$m-module.log" 2>&1
    rc=$?; rows+=("| $m | calibrate module | $rc | $((SECONDS - t0)) |")
  fi
  $PY -m autotune --model "$OUT/$m.json" --profile "$prof" --nodes 1 --gpus-per-node "$NGPU" \
    --pipeline "$NGPU" --sequence "$seq" --batch "$batch" --out "$OUT/$m-plan" > "$OUT/$m-search.log" 2>&1
  grep -E "^pipelined|^data parallel" "$OUT/$m-search.log"
  which=$($PY -c "import json, sys; print('best' if json.load(open(sys.argv[1]))['best']['stages'] else
    'baseline:pipelined')" "$OUT/$m-plan/plan.json")  # the search's pipelined plan: its best or its baseline
  t0=$SECONDS
  timeout "${EXEC_TIMEOUT:-150}" torchrun --nproc-per-node "$NGPU" -m autotune execute "$OUT/$m-plan/plan.json" \
    --which "$which" --module "$OUT/$m.json" --profile-steps 0 --out "$OUT/$m-exec" > "$OUT/$m-exec.log" 2>&1
  rc=$?; rows+=("| $m | execute | $rc | $((SECONDS - t0)) |")
  $PY -m autotune execute --summarize "$OUT/$m-exec" 2>&1 | tail -4
  [ "${PIPE_TIME:-1}" = 1 ] || continue
  t0=$SECONDS
  timeout "${TIME_TIMEOUT:-120}" torchrun --nproc-per-node "$NGPU" tests/gpu/pipe_time.py "$OUT/$m-plan/plan.json" \
    "$OUT/$m.json" pipelined > "$OUT/$m-time.txt" 2>&1
  rc=$?; rows+=("| $m | pipe_time | $rc | $((SECONDS - t0)) |")
  grep -E "^rank|^  (F|L|B|wait|optimizer) +x" "$OUT/$m-time.txt"
done
echo "| model | step | exit | seconds |"; echo "| --- | --- | ---: | ---: |"
printf '%s\n' "${rows[@]}"
