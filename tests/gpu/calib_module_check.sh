#!/usr/bin/env bash
# Issue 42 on the device machine, in parts (each one device call, under 9 minutes; results under $OUT, a table last):
#   PART=compute (nvidia-h200-x2: the overlap slowdown is measured beside NCCL collectives between 2 GPUs; on one GPU
#     it falls back to a copy stand-in, which the profile says): python -m calibrate compute on this machine, with
#     the host's cost per apply path and the overlap slowdown, into $OUT/profile.json (~4-5 min).
#   PART=module (nvidia-h200): for each held-out shape of reports/records/module_heldout.json (transformers' Llama,
#     Qwen2, Mistral, GPT-2 and a nanoGPT), python -m calibrate module, then the step measured on one GPU against
#     the prediction with the module section and without (tests/gpu/calib_module_check.py; ~5-7 min).
#     PROFILE=path/to/profile.json (the compute part's, copied into the tree) is required: without it this part
#     measures one first with fewer iterations (and then may not finish within one call).
#   PART=tune (nvidia-h200-x4; NGPU=2 on nvidia-h200-x2, the same piece a data rank): the held-out 1.5 B transformers Llama (tune_x4 of module_heldout.json: 16 x 2048, 8 K/V
#     heads, ffn 8192, vocabulary 128256, sequence 2048, batch 32 in 2 micro-batches): python -m calibrate module at
#     tensor widths 1, 2, 4 and the local micro-batches, then torchrun --nproc-per-node 4 -m autotune tune with that
#     profile (the searched plan and the best DDP / FSDP / tensor-parallel / pipelined plans, 4 steps each; the
#     measured fastest returned, tune.md its table; residuals into $OUT/tune-profile.json). PROFILE as above.
# e.g.  OUT=$OUT PART=compute bash tests/gpu/calib_module_check.sh
#       OUT=$OUT PART=module PROFILE=reports/records/calib-module-h200/profile.json bash tests/gpu/calib_module_check.sh
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
PY=${PY:-python3}
PART=${PART:-compute}
mkdir -p "$OUT"
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -2
case "$PART" in
  compute)
    timeout "${COMPUTE_TIMEOUT:-480}" $PY -m calibrate compute --profile "${BASE_PROFILE:-h200-nvlink+ib400}" \
      --out "$OUT/profile.json" --iters "${ITERS:-10}" --warmup 2 > "$OUT/compute.log" 2>&1
    rc=$?
    echo "calibrate compute: exit $rc ($((SECONDS - t0)) s)"
    grep -E "^\[compute\] (host|overlap|NVIDIA|memory )" "$OUT/compute.log" | tail -8
    [ $rc -ne 0 ] && tail -5 "$OUT/compute.log"
    $PY - "$OUT/profile.json" <<'PYEOF'
import sys
from calibrate.profile import Profile
c = Profile.load(sys.argv[1]).compute
print("| path | host us / layer occurrence / micro-batch | / step |\n| --- | ---: | ---: |")
for k, (a, b) in sorted(c.host_s.items()):
    print(f"| {k} | {a * 1e6:.1f} | {b * 1e6:.1f} |")
print("outside the blocks (us a micro-batch / a step):", {k: [round(x * 1e6) for x in v] for k, v in c.host_outside_s.items()})
print("overlap slowdown:", c.overlap, "| missing for multi-GPU planning:", c.missing_overheads() or "nothing")
PYEOF
    ;;
  module)
    profile=${PROFILE:-}
    if [ -z "$profile" ]; then
      timeout 300 $PY -m calibrate compute --profile h200-nvlink+ib400 --out "$OUT/profile.json" --iters 5 \
        --warmup 1 > "$OUT/compute.log" 2>&1 || { tail -5 "$OUT/compute.log"; exit 1; }
      profile=$OUT/profile.json
    fi
    # shellcheck disable=SC2086
    timeout "${CHECK_TIMEOUT:-500}" $PY tests/gpu/calib_module_check.py "$profile" --out "$OUT/module" ${CHECK_ARGS:-} \
      > "$OUT/module_check.txt" 2>&1
    echo "calib_module_check: exit $? ($((SECONDS - t0)) s)"
    cat "$OUT/module_check.txt"
    ;;
  tune)
    profile=${PROFILE:?PART=tune needs PROFILE=the compute part profile.json (host and overlap figures)}
    NGPU=${NGPU:-4}  # NGPU=2 (nvidia-h200-x2): each data rank's piece as on 4 (batch 8 a GPU in 2 micro-batches)
    WIDTHS=$([ "$NGPU" -ge 4 ] && echo 1,2,4 || echo 1,2); MBS=$([ "$NGPU" -ge 4 ] && echo 2,4,8,16 || echo 2,4,8)
    $PY - "$OUT/llama1.5b.json" <<'PYEOF'
import json, sys
row = json.load(open("reports/records/module_heldout.json"))["tune_x4"][0]
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": row["hidden"],
           "num_attention_heads": row["heads"], "num_key_value_heads": row["kv_heads"], "num_hidden_layers": row["layers"],
           "intermediate_size": row["ffn"], "vocab_size": row["vocabulary"], "max_position_embeddings": row["sequence"],
           "tie_word_embeddings": False}, open(sys.argv[1], "w"))
PYEOF
    timeout "${MODULE_TIMEOUT:-200}" $PY -m calibrate module --model "$OUT/llama1.5b.json" --profile "$profile"       --out "$OUT/tune-profile.json" --tensor "$WIDTHS" --micro-batches "$MBS" --sequence 2048 > "$OUT/module.log" 2>&1
    echo "calibrate module: exit $? ($((SECONDS - t0)) s)"; tail -3 "$OUT/module.log"
    [ -f "$OUT/tune-profile.json" ] || cp "$profile" "$OUT/tune-profile.json"
    t1=$SECONDS
    # the candidates run on transformers' LlamaForCausalLM of the config.json (tune's default for one; TUNE_MODULE=
    # pkg.mod:factory another module)
    timeout "${TUNE_TIMEOUT:-330}" torchrun --nproc-per-node "$NGPU" -m autotune tune --model "$OUT/llama1.5b.json" \
      --profile "$OUT/tune-profile.json" --out "$OUT/tune" ${TUNE_MODULE:+--module "$TUNE_MODULE"} -- --sequence 2048 --batch $((8 * NGPU)) --micro-batch $((4 * NGPU)) \
      > "$OUT/tune.log" 2>&1
    echo "autotune tune: exit $? ($((SECONDS - t1)) s)"
    grep -E "^\[tune\] [^s]|error" "$OUT/tune.log" | tail -8
    [ -f "$OUT/tune/tune.md" ] && cat "$OUT/tune/tune.md"
    ;;
  *) echo "unknown PART=$PART: use compute, module or tune"; exit 2 ;;
esac
