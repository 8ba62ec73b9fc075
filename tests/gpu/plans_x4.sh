#!/usr/bin/env bash
# Issues 41 and 42 on 4 GPUs (nvidia-h200-x4), one device call each part, under 10 minutes:
#   PART=measure: calibrate compute (bf16, host per apply path, overlap beside NCCL) on top of the collectives
#     measured on 4 H200 (BASE), into out/gpu/profile.json (kept on the machine for PART=tune, copied to $OUT),
#     then tests/gpu/apply_check.sh with that profile: every plan kind on transformers' LlamaForCausalLM 1.5 B.
#   PART=tune: calibrate module + autotune tune on the same machine with out/gpu/profile.json
#     (tests/gpu/calib_module_check.sh PART=tune, the candidates on transformers' classes).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/plans-out}
W=out/gpu
BASE=${BASE:-reports/records/collectives4-h200x4-2026-11-28/profile-h200x4-graph.json}
mkdir -p "$W" "$OUT"
t0=$SECONDS
case "${PART:-measure}" in
  measure)
    timeout "${COMPUTE_TIMEOUT:-270}" python3 -m calibrate compute --profile "$BASE" --out "$W/profile.json" \
      --dtypes bf16 --iters "${ITERS:-5}" --warmup 2 > "$OUT/compute.log" 2>&1
    echo "calibrate compute: exit $? ($((SECONDS - t0)) s)"; grep -E "^\[compute\] (host|overlap)" "$OUT/compute.log" | tail -6
    cp "$W/profile.json" "$OUT/profile.json" 2>/dev/null
    OUT=$W/ac PROFILE=$W/profile.json RUN_TIMEOUT=${RUN_TIMEOUT:-300} bash tests/gpu/apply_check.sh > "$OUT/apply.log" 2>&1
    echo "apply check: exit $? ($((SECONDS - t0)) s)"
    cp "$W"/ac/*.json "$W/ac/run.log" "$OUT/" 2>/dev/null
    grep -E "^\|" "$OUT/apply.log" || tail -20 "$OUT/apply.log"
    ;;
  tune)
    OUT=$W/tune PART=tune PROFILE=$W/profile.json TUNE_MODULE=apply_llama:build bash tests/gpu/calib_module_check.sh \
      > "$OUT/tune-console.log" 2>&1
    echo "tune: exit $? ($((SECONDS - t0)) s)"
    tar -czf "$OUT/tune.tar.gz" -C "$W" tune 2>/dev/null
    tail -30 "$OUT/tune-console.log"
    ;;
esac
