#!/usr/bin/env bash
# Issue 30 on GPUs: pipelined plans run on the GPUs of one node, measured beside the step model's prediction.
#   1. python -m calibrate run (NCCL, graph timing, the world group of this node) and calibrate fit: this
#      machine's collective tier; then python -m calibrate compute merged into it ($OUT/profile.json), so that
#      every prediction below uses figures measured on this machine;
#   2. the plans of a Llama (GQA, SwiGLU, RMSNorm, rotary, untied) and of a GPT (tied embedding and logits:
#      the first and last stages share a gradient): `python -m autotune --pipeline P --schedule S` for the
#      variants in VARIANTS (model:stages:schedule); each plan file holds the searched single-stage plan,
#      its baselines (data parallel, FSDP, Megatron, SUMMA, ...) and the pipelined plan;
#   3. python -m autotune execute under torchrun, one process per GPU: every plan of the first variant
#      (--which all), the pipelined plan alone of the others (WHICH: the same --which for every variant);
#   4. python -m autotune execute --summarize per variant: predicted against measured step time and memory.
# Any number of GPUs (NGPU, default all of nvidia-smi's); run from the repository root:
#   run(command="OUT=\$OUT/pipe bash tests/gpu/pipeline_check.sh", kind="nvidia-h100-x4")
# On CPUs (the logic, not the figures): DEVICE=cpu NGPU=4 PROFILE=h200-nvlink MODEL_LLAMA=... MODEL_GPT=...
# (PROFILE: plan with that profile instead of calibrating this machine; calibrate compute needs a GPU).
# COMPUTE_FROM=profile.json: calibrate the collectives here, take the compute figures from that profile.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUT=${OUT:-${1:-out}}
PY=${PY:-$(command -v python3)}   # absolute: mpirun may resolve a bare python3 on another PATH (one without mpi4py)
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
BACKEND=${CALIB_BACKEND:-nccl}
DEVICE=${DEVICE:-cuda}
source "$(dirname "$0")/mpi.sh"
MPI=${CALIB_MPI:-$(mpi_cmd "$NGPU" NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS \
  PYTHONUNBUFFERED PYTHONPATH)}
# 1.10 B parameters (Llama), 0.87 B (GPT): a step of about a quarter of a second on four H100s
MODEL_LLAMA=${MODEL_LLAMA:-"--model llama --layers 16 --hidden 2048 --heads 16 --kv-heads 4 --ffn 8192 --sequence 2048 --vocabulary 32000 --batch 32 --micro-batch 32"}
MODEL_GPT=${MODEL_GPT:-"--model gpt --layers 16 --hidden 2048 --heads 16 --sequence 2048 --vocabulary 32000 --batch 32 --micro-batch 32"}
VARIANTS=${VARIANTS:-"llama:4:1f1b llama:2:1f1b llama:4:gpipe llama:4:eager-1f1b gpt:4:1f1b"}
STEPS=${STEPS:-8}
FAILED=0
mkdir -p "$OUT"
t0=$SECONDS
status() { [ "$2" -eq 0 ] || FAILED=1; echo "== $1: exit $2 ($((SECONDS - t0)) s)"; }

if [ -z "${PROFILE:-}" ]; then
RESUME=(); [ -f "$OUT/calib/meta.json" ] && RESUME=(--resume)  # a call cut short continues its sweep
# shellcheck disable=SC2086  # $MPI and $PY are commands with their flags
timeout "${CALIB_TIMEOUT:-200}" $MPI $PY -m calibrate run --backend "$BACKEND" --mode "${CALIB_MODE:-graph}" --groups world \
  -b 4K -e "${CALIB_MAX:-1G}" -f 4 --reps 5 --check "${RESUME[@]}" --out "$OUT/calib" > "$OUT/calib.log" 2>&1
status "calibrate run ($BACKEND, $NGPU ranks)" $?
$PY -m calibrate fit "$OUT/calib" -o "$OUT/profile-comm.json" --name "this-node-x$NGPU" > "$OUT/fit.txt" 2>&1
status "calibrate fit" $?
if [ -n "${COMPUTE_FROM:-}" ]; then  # the compute figures of an earlier calibrate compute on this GPU model
  cp "$OUT/profile-comm.json" "$OUT/profile.json"
  $PY -m calibrate compute --out "$OUT/profile.json" --merge "$COMPUTE_FROM" > "$OUT/compute.log" 2>&1
  status "calibrate compute --merge $COMPUTE_FROM" $?
else
  timeout "${COMPUTE_TIMEOUT:-240}" $PY -m calibrate compute --profile "$OUT/profile-comm.json" --out "$OUT/profile.json" \
    --device "$DEVICE" ${COMPUTE_ARGS:---iters 10 --warmup 2} > "$OUT/compute.log" 2>&1
  status "calibrate compute" $?
fi
[ -f "$OUT/profile.json" ] || { echo "no profile measured on this machine: nothing predicted"; exit 1; }
PROFILE=$OUT/profile.json
fi

first=1
for v in $VARIANTS; do
  IFS=: read -r model stages schedule <<< "$v"
  name="$model-p$stages-$schedule"
  if [ "$model" = llama ]; then read -ra M <<< "$MODEL_LLAMA"; else read -ra M <<< "$MODEL_GPT"; fi
  timeout 120 $PY -m autotune "${M[@]}" --nodes 1 --gpus-per-node "$NGPU" --profile "$PROFILE" \
    --pipeline "$stages" --schedule "$schedule" --compare none --out "$OUT/$name" > "$OUT/$name.search.log" 2>&1
  status "search $name" $?
  grep -E "^(searched|pipelined|FSDP|data parallel)" "$OUT/$name.search.log"
  if [ $first -eq 1 ]; then which=${WHICH:-all}; else which=${WHICH:-baseline:pipelined}; fi
  first=0
  timeout "${EXEC_TIMEOUT:-240}" $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m autotune execute \
    "$OUT/$name/plan.json" --which "$which" --steps "$STEPS" --warmup 2 --profile-steps 0 --device "$DEVICE" \
    ${EXEC_ARGS:-} --out "$OUT/$name/exec" > "$OUT/$name.exec.log" 2>&1
  status "execute $name ($which)" $?
  tail -3 "$OUT/$name.exec.log"
  $PY -m autotune execute --summarize "$OUT/$name/exec" > "$OUT/$name/summary.txt" 2>&1
  cat "$OUT/$name/summary.txt"
  eval "${PACK_CMD:-true}"
done
echo "pipeline check: $((SECONDS - t0)) s, failed: $FAILED"
exit $FAILED
