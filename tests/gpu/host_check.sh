#!/usr/bin/env bash
# The host's cost of a training step on each of apply's paths: a small Llama whose kernels take less time than
# their issue (host-bound), at DEPTHS layers and batch / MICRO micro-batches, its data-parallel plan executed by
# DDP and by DTensor (--apply-path dtensor) and its FSDP plan by fully_shard, as `python -m autotune execute`
# runs them; then `execute --fit-host` fits each path's seconds per layer occurrence and micro-batch and per
# layer occurrence and step (autotune.execute.hostfit) into profile-host.json (PROFILE plus those figures).
# Any number of GPUs (NGPU, default all). The runs go to WORK (default a fresh temporary folder), packed after
# each into $OUT/host.tar.gz, the only file under $OUT (the device tool brings back only a few files a call).
#   run(command="OUT=\$OUT bash tests/gpu/host_check.sh", kind="nvidia-h100-x4")
# On CPUs (the logic): DEVICE=cpu NGPU=2 PROFILE=h200-nvlink bash tests/gpu/host_check.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}
PY=${PY:-$(command -v python3)}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
DEVICE=${DEVICE:-cuda}
PROFILE=${PROFILE:-reports/records/pipeline-gpu-2026-11-27/profile.json}
DEPTHS=${DEPTHS:-"2 8"}
BATCH=${BATCH:-16}
MICRO=${MICRO:-"16 4"}   # micro-batch sizes: BATCH / MICRO micro-batches
STEPS=${STEPS:-12}
MODEL=${MODEL:-"--model llama --hidden 256 --heads 4 --kv-heads 2 --ffn 512 --sequence 128 --vocabulary 1024"}
RUNS=${RUNS:-"data parallel:auto|data parallel:dtensor|FSDP:auto"}   # baseline:apply path
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT" "$WORK"
FAILED=0
DIRS=()
pack() { tar -czf "$OUT/host.tar.gz" --exclude=report.html -C "$WORK" . 2>/dev/null || true; }
read -ra M <<< "$MODEL"
IFS='|' read -ra R <<< "$RUNS"
for L in $DEPTHS; do
  for mb in $MICRO; do
    plan=$WORK/L$L-mb$mb
    timeout 120 "$PY" -m autotune "${M[@]}" --layers "$L" --batch "$BATCH" --micro-batch "$mb" --nodes 1 \
      --gpus-per-node "$NGPU" --profile "$PROFILE" --pipeline off --compare none --out "$plan" > "$plan.search.log" 2>&1 \
      || { FAILED=1; echo "== search L$L mb$mb failed"; continue; }
    for run in "${R[@]}"; do
      which=${run%%:*}; path=${run##*:}
      name=$WORK/L$L-mb$mb-${which// /-}-$path
      timeout "${EXEC_TIMEOUT:-120}" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m autotune \
        execute "$plan/plan.json" --which "baseline:$which" --apply-path "$path" --steps "$STEPS" --warmup 4 \
        --profile-steps 0 --device "$DEVICE" --out "$name" > "$name.log" 2>&1
      rc=$?; [ $rc -eq 0 ] && DIRS+=("$name") || FAILED=1
      echo "== execute L$L micro-batch $mb $which ($path): exit $rc"
      "$PY" -m autotune execute --summarize "$name" 2>&1 | sed -n 3p
      pack
    done
  done
done
"$PY" -m autotune execute --fit-host "${DIRS[@]}" --profile "$PROFILE" --profile-out "$WORK/profile-host.json" \
  2>&1 | tee "$WORK/fit.txt" || FAILED=1
pack
echo "host check: failed: $FAILED"
exit $FAILED
