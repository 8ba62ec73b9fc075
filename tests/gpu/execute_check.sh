#!/usr/bin/env bash
# Part "execute" of tests/gpu/run_all.sh (issue 15): plans of a GPT that fits the GPUs of one
# node, run for real and measured beside their predictions.
#   1. python -m calibrate compute: the GPU's matmul/attention/memory figures, merged into the
#      h200-nvlink profile ($OUT/profile.json), which every prediction below uses;
#   2. the searched plan (per objective when python -m autotune has --objective), data parallel,
#      Megatron, SUMMA and RANDOM_PLANS (10) random plans spread over the predicted step time
#      (tests/gpu/execute_plans.py says why), 15 in all;
#   3. python -m autotune execute --which all under torchrun, one process per GPU;
#   4. python -m autotune execute --summarize: the table (predicted vs measured step time,
#      communication time (the step's collectives replayed alone, and the in-step NCCL kernel
#      time), exposed communication, memory; Spearman; the targets) in $OUT/exec/summary.{json,md,txt},
#      then each plan's device time by kernel family and memory peak by phase (exec/breakdown.txt).
# Any number of GPUs (NGPU, default: all of nvidia-smi's); run from the repository root:
#   OUT=/path bash tests/gpu/execute_check.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUT=${OUT:-${1:-out}}
PY=${PY:-python3}
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
BASE=${BASE_PROFILE:-h200-nvlink}
mkdir -p "$OUT"
# MODEL_ARGS overrides the GPT (e.g. a tiny one for a dry run on CPUs)
read -ra MODEL <<< "${MODEL_ARGS:---layers 4 --hidden 4096 --heads 32 --sequence 1024 --vocabulary 32768 --batch 16 --micro-batch 8}"
CLUSTER=(--nodes 1 --gpus-per-node "$NGPU")
t0=$SECONDS

timeout 300 $PY -m calibrate compute --profile "$BASE" --out "$OUT/profile.json" --iters 10 --warmup 2 \
  > "$OUT/compute.log" 2>&1
rc=$?
echo "calibrate compute: exit $rc ($((SECONDS - t0)) s)"
PROFILE="$OUT/profile.json"
[ $rc -eq 0 ] || PROFILE=$BASE  # the datasheet figures: the table then says so through the profile

SEARCHED=()
if $PY -m autotune -h 2>/dev/null | grep -q -- "--objective"; then OBJECTIVES="step comm"; else OBJECTIVES="default"; fi
for obj in $OBJECTIVES; do
  args=(); [ "$obj" != default ] && args=(--objective "$obj")
  timeout 60 $PY -m autotune "${MODEL[@]}" "${CLUSTER[@]}" --profile "$PROFILE" --memory-limit 120 \
    --budget 2 --compare none "${args[@]}" --out "$OUT/search-$obj" > "$OUT/search-$obj.log" 2>&1
  echo "search ($obj objective): exit $?"
  [ -f "$OUT/search-$obj/plan.json" ] && SEARCHED+=("$obj=$OUT/search-$obj")
done
$PY tests/gpu/execute_plans.py "$OUT/plans.json" --searched "${SEARCHED[@]}" --random ${RANDOM_PLANS:-10} --profile "$PROFILE" \
  "${MODEL[@]}" "${CLUSTER[@]}" --memory-limit 120 2>&1 | tail -1

timeout 240 $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m autotune execute "$OUT/plans.json" \
  --which all --steps 8 --warmup 2 --profile-steps 2 --out "$OUT/exec" > "$OUT/execute.log" 2>&1
echo "execute: exit $? ($((SECONDS - t0)) s so far)"
tail -5 "$OUT/execute.log"
$PY -m autotune execute --summarize "$OUT/exec" | tee "$OUT/exec/summary.txt"
echo "execute part: $((SECONDS - t0)) s"
