#!/usr/bin/env bash
# Issue 41 on 4 GPUs (nvidia-h200-x4, under 8 minutes): a transformers LlamaForCausalLM of 1.5 B (16 layers x 2048,
# 8 K/V heads, ffn 8192, vocabulary 128256, sequence 2048, batch 32 in 2 micro-batches) built on the CPU; every
# plan kind (the searched plan, data parallel, FSDP, Megatron t=2 and t=4, pipelined 2 x 2, Megatron 3-D of 2
# stages of t=2: the tensor path in a pipeline) searched on the CPU
# with PROFILE first, then run through autotune.apply / apply_pipeline by execute's runners in one torchrun job,
# beside tensor parallelism composed by hand with torch's ParallelStyles at t=2 and 4 (tests/gpu/apply_llama.py).
# The table last; $OUT/apply_check.json holds the records.
#   run(command="OUT=\$OUT/ac bash tests/gpu/apply_check.sh", kind="nvidia-h200-x4")
# On CPUs (the logic): DEVICE=cpu NGPU=4 SMALL=--small bash tests/gpu/apply_check.sh
# PLAN_ARGS: more arguments of the plan step (tests/gpu/seqpar_check.sh: --sequence-parallel).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}
PY=${PY:-$(command -v python3)}
NGPU=${NGPU:-4}
DEVICE=${DEVICE:-cuda}
PROFILE=${PROFILE:-reports/records/plans-h200x4-2026-11-28/profile-h200x4-measured.json}
mkdir -p "$OUT"
# shellcheck disable=SC2086
timeout 300 $PY tests/gpu/apply_llama.py plan "$OUT" "$PROFILE" ${SMALL:-} --gpus "$NGPU" ${PLAN_ARGS:-} \
  || { echo "apply check: the search failed"; exit 1; }
timeout "${RUN_TIMEOUT:-420}" $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
  tests/gpu/apply_llama.py run "$OUT" --device "$DEVICE" > "$OUT/run.log" 2>&1
rc=$?
grep -v "^\[rank" "$OUT/run.log" | grep -E "^\|" || tail -30 "$OUT/run.log"
echo "apply check: exit $rc"
exit $rc
