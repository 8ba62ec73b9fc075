#!/usr/bin/env bash
# Issue 33's run, on a machine of 2 GPUs, in one device call:
#   run(command="OUT=$OUT bash tests/gpu/run_issue33.sh", kind="nvidia-h100-x2", carry=["build/msccl"])  # ~10 min
#   run(command="PARTS=schedule OUT=$OUT bash tests/gpu/run_issue33.sh", kind="nvidia-h100-x2",
#       carry=["build/msccl"])                                                                      # ~5 min
# PARTS (default all): all | schedule. "schedule" skips the NCCL tuner and takes NCCL's best setting per size from
# NCCL_RUN (default: this run's $R/nccl when it exists, else the 2 x H100 run recorded in
# reports/records/issue33-h100x2-2026-11-25; its table was chosen from that run's development sweep).
# 1. (all) python -m autotune nccl with its ablation arms (NCCL default, NCCL_MIN_CTAS alone, the table alone,
#    table + NCCL_MIN_CTAS, the sweep's best fixed setting), results checked after the timed rounds; then
#    python -m autotune nccl evaluate at the held-out sizes the run declared, in a fresh process.
# 2. python -m autotune schedule (allreduce), kernels bench of the tuned manifest (checked before and after the
#    timed graph replays; INTERP_BENCH=1 by default with PARTS=all, 0 with PARTS=schedule), python -m autotune
#    schedule evaluate at its held-out sizes with NCCL's best setting and the knob ablations, bounded by
#    --max-seconds 150 (a size that would end later is recorded as not measured) under a 200 s timeout.
# Every launcher under a timeout; a launcher that fails before Python starts (its flags) stops the script with its
# message; a failed step prints its log's last lines and makes the script's exit 1; everything packed into
# $OUT/issue33.tar.gz after each step.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue33}
R=$OUT/issue33
PY=${PY:-$(command -v python3)}   # absolute: mpirun may resolve a bare python3 on another PATH (2026-11-27: /usr/bin/python3, no mpi4py)
PARTS=${PARTS:-all}
INTERP_BENCH_DEFAULT=1
[ "$PARTS" = schedule ] && INTERP_BENCH_DEFAULT=0     # the short run: the bench only with INTERP_BENCH=1
INTERP_BENCH=${INTERP_BENCH:-$INTERP_BENCH_DEFAULT}
case "$PARTS" in all|schedule) ;; *) echo "PARTS=$PARTS: use all or schedule" >&2; exit 2 ;; esac
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d build/msccl ] && export COMMTUNE_MSCCL_DIR=$PWD/build/msccl
export COMMTUNE_MSCCL_DIR=${COMMTUNE_MSCCL_DIR:-}
# the launcher's flags for the MPI installed (Open MPI or MPICH: tests/gpu/mpi.sh)
source tests/gpu/mpi.sh
MPIRUN="$(mpi_cmd 2 NCCL_NVLS_ENABLE PYTHONUNBUFFERED PYTHONPATH COMMTUNE_MSCCL_DIR)"
mkdir -p "$R"
FAILED=""
pack() { tar -czf "$OUT/issue33.tar.gz" -C "$OUT" issue33; }
step() {  # step NAME SECONDS COMMAND...: one launcher under a timeout, its log kept, its exit printed
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc ($((SECONDS - t0)) s)"
  grep -E '^#|^\[schedule\] \[[0-9]+/|met|unknown|speed-up|geomean|wrong|NOT MEASURED' "$R/$name.log" | tail -16
  if [ "$rc" != 0 ]; then
    FAILED="$FAILED $name"
    echo "-- $name: last lines of its log"; tail -6 "$R/$name.log"
  fi
  pack
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt" 2>&1
cat "$R/gpus.txt"
echo "== PARTS=$PARTS; launcher: $MPIRUN"
# the launcher and its flags, before any step depends on them: 2 ranks that each see a world of 2
if ! timeout 60 $MPIRUN $PY -c "import mpi4py.MPI as M; print(M.COMM_WORLD.Get_size())" > "$R/launcher.log" 2>&1 \
   || [ "$(grep -cx 2 "$R/launcher.log")" != 2 ]; then
  echo "LAUNCHER FAILED: $MPIRUN (every step needs it):"; cat "$R/launcher.log"; pack; exit 1
fi
PLUGIN=$R/libnccl-tuner-commtune.so
[ -f "$PLUGIN" ] || step build-tuner 60 $PY -m kernels build-tuner --out "$PLUGIN"
if [ "$PARTS" = all ]; then
  step nccl-tune 230 $MPIRUN $PY -m autotune nccl --plugin "$PLUGIN" --collectives allreduce,allgather,reducescatter \
    --sizes 1K:1G:4 --out "$R/nccl"
  step nccl-evaluate 100 $MPIRUN $PY -m autotune nccl evaluate "$R/nccl" --plugin "$PLUGIN"
fi
if [ -z "${NCCL_RUN:-}" ]; then
  NCCL_RUN=reports/records/issue33-h100x2-2026-11-25
  # this run's, when its sweep got as far as writing the table
  $PY -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get('table') else 1)" \
    "$R/nccl/nccl_tune.json" 2>/dev/null && NCCL_RUN=$R/nccl
fi
echo "== NCCL's best setting per size from $NCCL_RUN"
step schedule-tune 130 $MPIRUN $PY -m autotune schedule --collective allreduce --gpus 2 --sizes 1K:1G:16 --out "$R/schedule"
[ "$INTERP_BENCH" = 1 ] && step interp-bench 50 $MPIRUN $PY -m kernels bench --collectives allreduce --factor 16 \
  --preset "$R/schedule/manifest.json" --explain --out "$R/bench"
NCCL_FLAGS=()
[ -f "$PLUGIN" ] && NCCL_FLAGS=(--nccl-run "$NCCL_RUN" --plugin "$PLUGIN")
[ -f "$PLUGIN" ] || echo "no plugin at $PLUGIN: schedule evaluate runs without NCCL's best setting (unknown)"
step schedule-evaluate 200 $MPIRUN $PY -m autotune schedule evaluate "$R/schedule" --max-seconds 150 \
  ${NCCL_FLAGS[@]+"${NCCL_FLAGS[@]}"}
for f in "$R/nccl/nccl_evaluate.json" "$R/schedule/schedule_evaluate.json"; do
  [ -f "$f" ] && $PY -m reports tables "$f" > "${f%.json}.md" 2>&1 && cat "${f%.json}.md"
done
pack
if [ -n "$FAILED" ]; then echo "== FAILED:$FAILED (logs in $R)"; exit 1; fi
echo "== every step exited 0"
