#!/usr/bin/env bash
# Issues 41 and 42 on 4 GPUs (nvidia-h200-x4), one device call each part, under 10 minutes:
#   PART=measure: calibrate compute (bf16, host per apply path, overlap beside NCCL) on top of the collectives
#     measured on 4 H200 (BASE), into out/gpu/profile.json (kept on the machine for PART=tune, copied to $OUT),
#     with MODULE=1 then calibrate module on the checked Llama's config (MODULE_WIDTHS, MODULE_MBS), then
#     tests/gpu/apply_check.sh with that profile: every plan kind on transformers' LlamaForCausalLM 1.5 B
#     (NGPU=2: on 2 GPUs, each data rank's piece as on 4). The apply check's in-turn comparisons of ours against
#     the hand composition add about 90 s on 4 GPUs: with MODULE=1 give the parts their own calls (MODULE_TIMEOUT,
#     RUN_TIMEOUT) or expect the 600 s limit.
#   PART=tensor: calibrate compute as above, then tests/gpu/seqpar_check.sh with that profile (Megatron t=2, and 4
#     on 4 GPUs, without and with sequence parallelism, beside torchtitan's composition by hand).
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
compute() {
  timeout "${COMPUTE_TIMEOUT:-270}" python3 -m calibrate compute --profile "$BASE" --out "$W/profile.json" \
    --dtypes bf16 --iters "${ITERS:-5}" --warmup 2 > "$OUT/compute.log" 2>&1
  echo "calibrate compute: exit $? ($((SECONDS - t0)) s)"; grep -E "^\[compute\] (host|overlap)" "$OUT/compute.log" | tail -9
  cp "$W/profile.json" "$OUT/profile.json" 2>/dev/null
}
case "${PART:-measure}" in
  tensor)  # calibrate compute, then Megatron t=2 (and 4) without and with sequence parallelism beside the hand
    # composition (tests/gpu/seqpar_check.sh) priced by that profile: the tensor path's host figures checked
    compute
    OUT=$W/sp PROFILE=$W/profile.json RUN_TIMEOUT=${RUN_TIMEOUT:-300} bash tests/gpu/seqpar_check.sh > "$OUT/sp.log" 2>&1
    echo "seqpar check: exit $? ($((SECONDS - t0)) s)"
    cp "$W"/sp/*.json "$OUT/" 2>/dev/null
    grep -E "^\|" "$OUT/sp.log" || tail -20 "$OUT/sp.log"
    ;;
  measure)
    compute
    if [ -n "${MODULE:-}" ]; then  # the user's module calibrated on this machine (one GPU, and its paths' host among 2)
      python3 -c "import json; json.dump({'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 2048,
        'num_attention_heads': 16, 'num_key_value_heads': 8, 'head_dim': 128, 'num_hidden_layers': 16,
        'intermediate_size': 8192, 'vocab_size': 128256, 'max_position_embeddings': 2048,
        'tie_word_embeddings': False}, open('$W/llama1.5b.json', 'w'))"
      timeout "${MODULE_TIMEOUT:-300}" python3 -m calibrate module --model "$W/llama1.5b.json" --profile "$W/profile.json" \
        --out "$W/profile.json" --tensor "${MODULE_WIDTHS:-1,2}" --micro-batches "${MODULE_MBS:-2,4,8}" --sequence 2048 \
        > "$OUT/module.log" 2>&1
      echo "calibrate module: exit $? ($((SECONDS - t0)) s)"; grep -E "host|whole run" "$OUT/module.log" | tail -9
      cp "$W/profile.json" "$OUT/profile-module.json" 2>/dev/null
    fi
    OUT=$W/ac PROFILE=$W/profile.json RUN_TIMEOUT=${RUN_TIMEOUT:-360} bash tests/gpu/apply_check.sh > "$OUT/apply.log" 2>&1
    echo "apply check: exit $? ($((SECONDS - t0)) s)"
    cp "$W"/ac/*.json "$W/ac/run.log" "$OUT/" 2>/dev/null
    grep -E "^\|" "$OUT/apply.log" || tail -20 "$OUT/apply.log"
    ;;
  tune)
    OUT=$W/tune PART=tune PROFILE=$W/profile.json bash tests/gpu/calib_module_check.sh \
      > "$OUT/tune-console.log" 2>&1
    echo "tune: exit $? ($((SECONDS - t0)) s)"
    tar -czf "$OUT/tune.tar.gz" -C "$W" tune 2>/dev/null
    tail -30 "$OUT/tune-console.log"
    ;;
esac
