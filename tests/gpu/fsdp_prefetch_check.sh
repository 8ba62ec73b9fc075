#!/usr/bin/env bash
# Issue 42: what the step model assumes of FSDP2's forward all-gathers under implicit prefetch, measured on run 4's
# transformers Llama (tests/gpu/fsdp_prefetch_check.py): the forward's share of the host's issue time, each
# micro-batch's forward and backward on the device, the step with and without the loss read each step.
#   run(command="OUT=\$OUT bash tests/gpu/fsdp_prefetch_check.sh", kind="nvidia-h200-x2")   (about 3 minutes)
# On CPUs (the logic): DEVICE=cpu SMALL=--small bash tests/gpu/fsdp_prefetch_check.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}
PY=${PY:-$(command -v python3)}
NGPU=${NGPU:-2}
mkdir -p "$OUT"
timeout "${TIMEOUT:-420}" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
  tests/gpu/fsdp_prefetch_check.py "$OUT" ${SMALL:-} --device "${DEVICE:-cuda}" --profile "${PROFILE:-reports/records/plans-h200x2-2026-11-28/profile-h200x2-run4.json}" > "$OUT/fsdp_prefetch.log" 2>&1
rc=$?
[ $rc -eq 0 ] || echo "fsdp prefetch check: exit $rc (log: $OUT/fsdp_prefetch.log)"
tail -n 22 "$OUT/fsdp_prefetch.log"
exit $rc
