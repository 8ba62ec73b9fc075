#!/usr/bin/env bash
# calibrate module's tensor widths timed one after the other (--gpus 1) and shared out to every visible GPU at once
# (the default), on transformers' Llama 8 B shape at its default shapes (widths 1,2,4,8 x micro-batches 1,2,4,
# sequence 2048, the host's cost included): each run's seconds, and each shape's block figures of the shared-out
# run over the one-after-the-other run's (issue 42: at most 3 minutes). nvidia-h200-x2 or x4, ~6 min.
set -uo pipefail
OUT=${OUT:-out}/lanes; mkdir -p "$OUT"
for g in 1 0; do   # 0: the default (every visible GPU)
  ARGS=$([ "$g" = 1 ] && echo "--gpus 1") MODELS=llama8b OUT=$OUT/gpus$g bash tests/gpu/module_time.sh | tail -1
done
python3 - "$OUT" <<'PYEOF'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/gpus{g}/llama8b-profile.json"))["module"]["points"] for g in (1, 0))
one = {(p["tensor"], p["micro_batch"]): p["block"] for p in a}
print("| tensor | micro-batch | forward | backward | optimizer | user step (shared out / one after the other) |")
print("| ---: | ---: | ---: | ---: | ---: | ---: |")
for p in b:
    k = (p["tensor"], p["micro_batch"])
    if k in one:
        r = [p["block"][x] / one[k][x] if one[k][x] else float("nan") for x in ("forward_s", "backward_s", "optimizer_s", "step_s")]
        print(f"| {k[0]} | {k[1]} | " + " | ".join(f"{x:.3f}" for x in r) + " |")
PYEOF
