#!/usr/bin/env bash
# Every GPU check and benchmark of the project, in one device call (nvidia-h200-x2):
#   run(command="bash tests/gpu/run_all.sh", kind="nvidia-h200-x2")
# Installs nothing. Full results go to $OUT/gpu-results.tar.gz (and the log to
# $OUT/log.txt); a short table is printed last. Parts can be chosen with
# PARTS="calibrate interp ..." (default: all but "transformer"). Part "transformer" (issue 26's one-GPU
# target: tests/gpu/transformer_check.sh) needs one GPU and no mpirun; run it alone on a one-GPU machine:
#   run(command="PARTS=transformer bash tests/gpu/run_all.sh", kind="nvidia-h100-x1")  (or nvidia-h200)
# Part "pipeline" (issue 30: pipelined plans executed beside the step model, tests/gpu/pipeline_check.sh; about
# 8 minutes on 4 GPUs) is not in the default either: PARTS=pipeline, on a machine of 2 or 4 GPUs; nor is part
# "host" (the host's cost of each apply path, fitted into a profile: tests/gpu/host_check.sh, about 6 minutes), nor
# "seqpar" (tensor parallelism without and with sequence parallelism, applied and by hand: tests/gpu/seqpar_check.sh,
# about 3 minutes on 2 GPUs).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}
R=$OUT/results
mkdir -p "$R"
PY=${PY:-python3}
# ../shared does not travel to the device machine: copy the reference MSCCL XML into
# build/msccl here and carry it (run(..., carry=["build/msccl"])).
[ -d build/msccl ] && export COMMTUNE_MSCCL_DIR=$PWD/build/msccl
export COMMTUNE_MSCCL_DIR=${COMMTUNE_MSCCL_DIR:-}
# every mpirun under a timeout: a hung NCCL call must not eat the device call (2026-11-22: the bare
# loop hung once and took the whole 10 minutes)
# the launcher's flags for the MPI installed (Open MPI or MPICH: tests/gpu/mpi.sh)
source tests/gpu/mpi.sh
MPIRUN="timeout 300 $(mpi_cmd 2 NCCL_NVLS_ENABLE PYTHONUNBUFFERED PYTHONPATH COMMTUNE_MSCCL_DIR OUT)"
export CALIB_MPI=${CALIB_MPI:-$(mpi_cmd 2 NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS \
  PYTHONUNBUFFERED PYTHONPATH)}
FAILED=0
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PARTS=${PARTS:-"calibrate interp sbp reshard model schedule peers execute nccl"}  # add "bare" for the bare NCCL loop beside calibrate
SUMMARY=$R/summary.txt
: > "$SUMMARY"
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
# results are packed after every part, so that a run cut short still brings back what it measured
pack() { tar -czf "$OUT/gpu-results.tar.gz" -C "$OUT" results; }
declare -A ARGS=()
log() { echo "== $*" | tee -a "$SUMMARY"; }
# status STEP RC: the step's exit in the summary; any failure makes this script's own exit non-zero
status() { [ "$2" -eq 0 ] || FAILED=1; log "$1: exit $2"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt" 2>&1
nvidia-smi topo -m >> "$R/gpus.txt" 2>&1

if has calibrate; then
  # adaptive sweeps (graph, host), fits, and validation at random sizes: tests/gpu/calib_check.sh
  # shellcheck disable=SC2097,SC2098  # PACK_CMD packs the outer $OUT; the script writes into OUT=$R
  PACK_CMD="tar -czf $OUT/gpu-results.tar.gz -C $OUT results" OUT="$R" PY=$PY bash tests/gpu/calib_check.sh \
    > "$R/calibrate.log" 2>&1
  status calibrate $?
  cat "$R/calibrate.log" | tee -a "$SUMMARY"
  pack
  if has bare; then
    $MPIRUN $PY tests/gpu/nccl_bare_loop.py "$R/bare.csv" > "$R/bare.log" 2>&1
    status "bare loop" $?
    $PY tests/gpu/nccl_bare_loop.py --compare "$R/bare.csv" "$R/calib-graph" "$R/calib-host" > "$R/bare-compare.txt" 2>&1
    log "$(tail -1 "$R/bare-compare.txt")"
    pack
  fi
fi

# part "model": the interpreter sweep the schedule autotuner's model is fitted on, fitted here, so
# that part "schedule" of the same call ranks with the interpreter as it is now (a different run
# from the schedule's own measurements)
if has model; then
  $MPIRUN $PY -m kernels bench --sweep model --out "$R/model-sweep" > "$R/model-sweep.log" 2>&1
  status "interpreter sweep for the model" $?
  $PY -m autotune schedule --fit-model "$R/model-sweep/tune.json" > "$R/interp_model.json" 2> "$R/fit-model.log" \
    && export SCHEDULE_ARGS="--model-params $R/interp_model.json"
  log "model fit: exit $? ${SCHEDULE_ARGS:-(schedule keeps the shipped parameters)}"
  pack
fi

if has transformer; then  # one GPU, no mpirun: its own block (the loop below runs .py checks under mpirun)
  mkdir -p "$R/transformer"
  OUT="$R/transformer" PY=$PY bash tests/gpu/transformer_check.sh > "$R/transformer/log.txt" 2>&1
  status "transformer (tests/gpu/transformer_check.sh)" $?
  tail -40 "$R/transformer/log.txt" | tee -a "$SUMMARY"
  pack
fi

for part in interp sbp reshard schedule execute nccl peers pipeline host seqpar; do  # peers after nccl: it uses nccl's tuner table
  has $part || continue
  for script in tests/gpu/${part}*_check.sh tests/gpu/${part}*_check.py; do
    [ -f "$script" ] || continue
    mkdir -p "$R/$part"
    case "$script" in
      *.sh) OUT="$R/$part" WORK="$R/$part/work" bash "$script" > "$R/$part/log.txt" 2>&1 ;;
      *.py) OUT="$R/$part" $MPIRUN $PY "$script" "$R/$part" ${ARGS[$part]:-} > "$R/$part/log.txt" 2>&1 ;;
    esac
    status "$part ($script)" $?
    tail -25 "$R/$part/log.txt"
    pack
  done
done

pack
echo
echo "==================== summary ===================="
cat "$SUMMARY"
exit $FAILED
