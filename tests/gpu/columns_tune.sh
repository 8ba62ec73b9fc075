#!/usr/bin/env bash
# FSDP with the embedding split by columns on the fully_shard path (step model 2026-11-30j), on the GPUs visible
# (nvidia-h200-x2): its numerical check under NCCL (tests/gpu/columns_check.py), then `autotune tune` on the seen
# Qwen2.5 7B shape (untied: the command's plan is that path) with session 33's measured module profile, so its
# four candidates' steps say whether the path is priced right beside FSDP. Results under $OUT, the tune table last.
#   OUT=$OUT bash tests/gpu/columns_tune.sh          (about 7 minutes on 2 x H200)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/columns}; PY=${PY:-python3}; mkdir -p "$OUT"
NGPU=${NGPU:-$($PY -c "import torch; print(torch.cuda.device_count())")}
RECORD=reports/records/plans-h200x2-2026-11-30/session33-call1-modules-recompute.tar.gz
timeout "${CHECK_TIMEOUT:-120}" torchrun --nproc-per-node "$NGPU" tests/gpu/columns_check.py 2>&1 | tee "$OUT/check.log"
echo "columns_check exit ${PIPESTATUS[0]}"
$PY tests/gpu/hf_configs.py "$OUT" 8192
tar xzf "$RECORD" -C "$OUT" qwen7b-profile.json
timeout "${TUNE_TIMEOUT:-500}" torchrun --nproc-per-node "$NGPU" -m autotune tune --model "$OUT/qwen7b.json" \
  --profile "$OUT/qwen7b-profile.json" --out "$OUT/qwen7b-tune" > "$OUT/qwen7b-tune.log" 2>&1
echo "tune exit $?"
grep -E "^\[tune\]" "$OUT/qwen7b-tune.log" | tail -8
[ -f "$OUT/qwen7b-tune/tune.md" ] && cat "$OUT/qwen7b-tune/tune.md"
