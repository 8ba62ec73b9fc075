#!/usr/bin/env bash
# Issue 33's run, on a machine of 2 GPUs, in one device call (about 9 minutes):
#   run(command="OUT=$OUT bash tests/gpu/run_issue33.sh", kind="nvidia-h100-x2", carry=["build/msccl"])
# 1. python -m autotune nccl with its ablation arms (NCCL default, NCCL_MIN_CTAS alone, the table alone, table +
#    NCCL_MIN_CTAS, the sweep's best fixed setting), results checked after the timed rounds; then
#    python -m autotune nccl evaluate at the held-out sizes the run declared, in a fresh process.
# 2. python -m autotune schedule (allreduce), kernels bench of the tuned manifest (checked before and after the
#    timed graph replays), python -m autotune schedule evaluate at its held-out sizes.
# The sweeps are coarser than tests/gpu/nccl_check.sh's and schedule_check.sh's (a size every 4x, three
# collectives) to fit one call; every launcher under a timeout; everything packed into $OUT/issue33.tar.gz.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue33}
R=$OUT/issue33
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d build/msccl ] && export COMMTUNE_MSCCL_DIR=$PWD/build/msccl
export COMMTUNE_MSCCL_DIR=${COMMTUNE_MSCCL_DIR:-}
MPIRUN="mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x PYTHONPATH -x COMMTUNE_MSCCL_DIR"
mkdir -p "$R"
pack() { tar -czf "$OUT/issue33.tar.gz" -C "$OUT" issue33; }
step() {  # step NAME SECONDS COMMAND...: one launcher under a timeout, its log kept, its exit printed
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc ($((SECONDS - t0)) s)"
  grep -E '^#|met|unknown|speed-up|geomean|wrong' "$R/$name.log" | tail -14
  pack
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt" 2>&1
cat "$R/gpus.txt"
PLUGIN=$R/libnccl-tuner-commtune.so
step build-tuner 60 $PY -m kernels build-tuner --out "$PLUGIN"
step nccl-tune 230 $MPIRUN $PY -m autotune nccl --plugin "$PLUGIN" --collectives allreduce,allgather,reducescatter \
  --sizes 1K:1G:4 --out "$R/nccl"
step nccl-evaluate 100 $MPIRUN $PY -m autotune nccl evaluate "$R/nccl" --plugin "$PLUGIN"
step schedule-tune 130 $MPIRUN $PY -m autotune schedule --collective allreduce --gpus 2 --sizes 1K:1G:16 --out "$R/schedule"
step interp-bench 50 $MPIRUN $PY -m kernels bench --collectives allreduce --factor 16 \
  --preset "$R/schedule/manifest.json" --explain --out "$R/bench"
step schedule-evaluate 60 $MPIRUN $PY -m autotune schedule evaluate "$R/schedule"
for f in "$R/nccl/nccl_evaluate.json" "$R/schedule/schedule_evaluate.json"; do
  [ -f "$f" ] && $PY -m reports tables "$f" > "${f%.json}.md" 2>&1 && cat "${f%.json}.md"
done
pack
