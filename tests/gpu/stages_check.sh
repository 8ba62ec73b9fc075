#!/usr/bin/env bash
# Issue 30 on several GPUs without calibrating again: a profile measured earlier on this machine kind (its node's
# NCCL tier and its GPU's `calibrate compute`, chosen by the GPU's name), then
#   1. tests/gpu/pipeline_check.sh for VARIANTS (default: 2 stages of 2 GPUs of the Llama, the pipelined plan);
#   2. the first variant's single-stage data-parallel (DDP) and FSDP (fully_shard) rows, executed as `execute`
#      runs them (each rank its piece of the batch);
#   3. one GPU alone with one rank's share of the batch (the same plan's compute, no communication): whether a
#      gap of the multi-GPU rows is the compute model's or the communication's.
# On CPUs (the logic): GPU=cpu DEVICE=cpu NGPU=4 PROFILE=h200-nvlink MODEL_LLAMA="..." (pipeline_check.sh's header).
# Everything under $OUT goes back packed in $OUT/stages.tar.gz (a run cut short keeps what it measured).
#   run(command="OUT=\$OUT/st bash tests/gpu/stages_check.sh", kind="nvidia-h100-x4")
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}
PY=${PY:-$(command -v python3)}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)}
DEVICE=${DEVICE:-cuda}
case "$GPU" in
  *H200*) PROFILE=${PROFILE:-reports/records/pipeline-gpu-2026-11-27-s12/profile-h200x4.json} ;;
  *H100*) PROFILE=${PROFILE:-reports/records/pipeline-gpu-2026-11-27/profile.json} ;;
  *) [ -n "${PROFILE:-}" ] || { echo "no profile of this machine kind ($GPU): set PROFILE"; exit 1; } ;;
esac
echo "== $NGPU x $GPU, profile $PROFILE"
mkdir -p "$OUT"
PACK="tar -czf '$OUT/stages.tar.gz' --exclude='*.tar.gz' --exclude=report.html -C '$OUT' . 2>/dev/null || true"
pack() { eval "$PACK"; }
FAILED=0
VARIANTS=${VARIANTS:-llama:2:1f1b}
OUT=$OUT PROFILE=$PROFILE DEVICE=$DEVICE NGPU=$NGPU WHICH=${WHICH:-baseline:pipelined} VARIANTS=$VARIANTS PACK_CMD=$PACK \
  bash tests/gpu/pipeline_check.sh || FAILED=1
IFS=: read -r model stages schedule <<< "${VARIANTS%% *}"
plan=$OUT/$model-p$stages-$schedule/plan.json
for which in "data parallel" FSDP; do
  name=single-${which%% *}
  timeout "${EXEC_TIMEOUT:-150}" $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m autotune execute \
    "$plan" --which "baseline:$which" --steps 8 --warmup 2 --profile-steps 0 --device "$DEVICE" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || FAILED=1; echo "== execute $which: exit $rc"
  $PY -m autotune execute --summarize "$OUT/$name" 2>&1 | sed -n 2,3p
  pack
done
# one rank's share of the batch on one GPU: the multi-GPU plans' compute alone
read -ra M <<< "${MODEL_LLAMA:-"--model llama --layers 16 --hidden 2048 --heads 16 --kv-heads 4 --ffn 8192 --sequence 2048 --vocabulary 32000"}"
share=$((${BATCH:-32} / NGPU))  # BATCH: the batch of MODEL_LLAMA
timeout 120 $PY -m autotune "${M[@]}" --batch "$share" --micro-batch "$share" --nodes 1 --gpus-per-node 1 \
  --profile "$PROFILE" --compare none --out "$OUT/one-gpu" > "$OUT/one-gpu.search.log" 2>&1 || FAILED=1
CUDA_VISIBLE_DEVICES=0 timeout "${EXEC_TIMEOUT:-150}" $PY -m torch.distributed.run --standalone --nproc-per-node 1 \
  -m autotune execute "$OUT/one-gpu/plan.json" --steps 8 --warmup 2 --profile-steps 0 --device "$DEVICE" --out "$OUT/one-gpu/exec" \
  > "$OUT/one-gpu.exec.log" 2>&1
rc=$?; [ $rc -eq 0 ] || FAILED=1; echo "== execute one GPU, batch $share: exit $rc"
$PY -m autotune execute --summarize "$OUT/one-gpu/exec" 2>&1 | sed -n 2,3p
pack
echo "stages check: failed: $FAILED"
exit $FAILED
