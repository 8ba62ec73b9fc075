#!/usr/bin/env bash
# Every 4-GPU plan kind's memory on ONE GPU (nvidia-h200; tests/gpu/plans_fake.py): with MODULE=1 the checked
# Llama's module calibrated first on the base profile (the flow users run), then apply_llama's plans for GPUS
# searched with that profile and each run as rank 0 of a fake process group of GPUS. About 6 minutes.
#   OUT=$OUT MODULE=1 bash tests/gpu/plans_fake.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/plans-fake-out}
W=out/gpu
PROFILE=${PROFILE:-reports/records/plans-h200x4-2026-11-28/profile-h200x4-measured.json}
mkdir -p "$W" "$OUT"
t0=$SECONDS
if [ -n "${MODULE:-}" ]; then
  python3 -c "import json; json.dump({'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 2048,
    'num_attention_heads': 16, 'num_key_value_heads': 8, 'head_dim': 128, 'num_hidden_layers': 16,
    'intermediate_size': 8192, 'vocab_size': 128256, 'max_position_embeddings': 2048,
    'tie_word_embeddings': False}, open('$W/llama1.5b.json', 'w'))"
  timeout "${MODULE_TIMEOUT:-220}" python3 -m calibrate module --model "$W/llama1.5b.json" --profile "$PROFILE" \
    --out "$W/profile-module.json" --tensor "${MODULE_WIDTHS:-1,2,4}" --micro-batches "${MODULE_MBS:-4,8,16}" \
    --sequence 2048 > "$OUT/module.log" 2>&1
  echo "calibrate module: exit $? ($((SECONDS - t0)) s)"; tail -4 "$OUT/module.log"
  cp "$W/profile-module.json" "$OUT/" 2>/dev/null && PROFILE=$W/profile-module.json
fi
timeout "${PLAN_TIMEOUT:-200}" python3 tests/gpu/plans_fake.py plan "$W/pf" "$PROFILE" --gpus "${GPUS:-4}" \
  > "$OUT/plan.log" 2>&1
echo "plan: exit $? ($((SECONDS - t0)) s)"; tail -2 "$OUT/plan.log"
timeout "${RUN_TIMEOUT:-420}" python3 tests/gpu/plans_fake.py all "$W/pf" --device cuda > "$OUT/fake.log" 2>&1
echo "fake runs: exit $? ($((SECONDS - t0)) s)"
tar -czf "$OUT/plans_fake.tar.gz" -C "$W" pf 2>/dev/null
grep -E "^\|" "$OUT/fake.log" || tail -30 "$OUT/fake.log"
