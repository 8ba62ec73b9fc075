#!/usr/bin/env bash
# How long `python -m calibrate module` takes at its default shapes (tensor widths that divide the model, micro-batches
# 1,2,4, sequence 2048, the host's cost on a group of one) for a 1.5 B and an 8 B transformers Llama on one GPU
# (issue 42: at most 3 minutes for a 1-8 B model). nvidia-h200, ~6-9 min. Results under $OUT, a table last.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}; PY=${PY:-python3}; mkdir -p "$OUT"
PROFILE=${PROFILE:-reports/records/plans-h200x4-2026-11-28/profile-h200x4-measured.json}
$PY - "$OUT" <<'PYEOF'
import json, sys
for name, (layers, hidden, heads, kv, ffn) in {"llama1.5b": (16, 2048, 32, 8, 8192),
                                               "llama8b": (32, 4096, 32, 8, 14336)}.items():
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
               "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": layers,
               "intermediate_size": ffn, "vocab_size": 128256, "max_position_embeddings": 2048,
               "tie_word_embeddings": False}, open(f"{sys.argv[1]}/{name}.json", "w"))
PYEOF
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
