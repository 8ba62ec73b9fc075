#!/usr/bin/env bash
# Issue 27's one-GPU target: a searched plan executed through autotune.apply on the project's reference
# modules (python -m autotune execute), its step time beside the plan's prediction, for a development shape
# (D3) and a held-out one (H4) of reports/records/transformer_shapes.json, with the profile that
# tests/gpu/transformer_check.sh measured on this machine:
#   OUT=/path PROFILE=/path/profile.json bash tests/gpu/transformer_apply.sh
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}
PY=${PY:-python3}
PROFILE=${PROFILE:?the profile calibrate compute wrote on this machine}
mkdir -p "$OUT"
shape() {  # the shape's fields as the search's flags
  $PY - "$1" <<'PYEOF'
import json, sys
d = json.load(open("reports/records/transformer_shapes.json"))
s = next(x for x in d["development"] + d["heldout"] if x["id"] == sys.argv[1])
flags = {"layers": s["layers"], "hidden": s["hidden"], "heads": s["heads"], "kv-heads": s["kv_heads"], "ffn": s["ffn"],
         "sequence": s["sequence"], "vocabulary": s["vocabulary"], "batch": s["micro_batch"],
         "micro-batch": s["micro_batch"], "tied": str(s["tied"]).lower(), "qkv-bias": str(s.get("qkv_bias", False)).lower()}
print(s["family"], " ".join(f"--{k} {v}" for k, v in flags.items()))
PYEOF
}
for id in ${APPLY_IDS:-D3 H4}; do
  read -r family flags < <(shape "$id")
  # shellcheck disable=SC2086
  timeout 120 $PY -m autotune --model "$family" $flags --nodes 1 --gpus-per-node 1 --profile "$PROFILE" \
    --compare none --out "$OUT/plan-$id" > "$OUT/search-$id.log" 2>&1
  echo "search $id: exit $?"
  timeout 180 torchrun --nproc-per-node 1 -m autotune execute "$OUT/plan-$id/plan.json" --steps 10 --warmup 3 \
    --out "$OUT/exec-$id" > "$OUT/execute-$id.log" 2>&1
  echo "execute $id: exit $?"
  tail -12 "$OUT/execute-$id.log"
done
