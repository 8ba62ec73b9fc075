#!/usr/bin/env bash
# Issue 9: validation at 8 GPUs, in one device call on nvidia-h200-x8 (or the parts
# that fit on -x4 with NP=4):
#   run(command="bash tests/gpu/run_8gpu.sh", kind="nvidia-h200-x8", carry=["build/msccl"])
# after `mkdir -p build/msccl && cp ../shared/interop/msccl/*.xml build/msccl/` here.
# Installs nothing; full results in $OUT/gpu8-results.tar.gz, a short table last.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu8-out}
NP=${NP:-8}
R=$OUT/results8
mkdir -p "$R"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d build/msccl ] && export COMMTUNE_MSCCL_DIR=$PWD/build/msccl
export COMMTUNE_MSCCL_DIR=${COMMTUNE_MSCCL_DIR:-}
mpi() { local n=$1; shift; mpirun --allow-run-as-root -np "$n" -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED \
          -x PYTHONPATH -x COMMTUNE_MSCCL_DIR -x OUT "$@"; }
SUMMARY=$R/summary.txt
: > "$SUMMARY"
log() { echo "== $*" | tee -a "$SUMMARY"; }
nvidia-smi topo -m > "$R/topo.txt" 2>&1

# 1. calibration at 2, 4 and 8 GPUs (graph mode, all collectives), fits, flatness, 2-GPU model at 4 and 8
sizes=""
for n in 2 4 8; do
  [ "$n" -le "$NP" ] || continue
  mpi "$n" $PY -m calibrate run --backend nccl --mode graph -b 1K -e 1G -f 1.41421356 --check --groups world \
    --out "$R/calib-np$n" > "$R/calib-np$n.log" 2>&1
  log "calibrate np=$n: exit $?"
  sizes="$sizes $R/calib-np$n"
done
$PY -m calibrate fit "$R/calib-np2" -o "$R/profile-np2.json" > "$R/fit-np2.txt" 2>&1
$PY -m calibrate fit $sizes -o "$R/profile-all.json" > "$R/fit-all.txt" 2>&1   # warns where busbw is not flat across p
log "flatness: $(grep -c 'varies across p' "$R/fit-all.txt") collective(s) flagged"
# shellcheck disable=SC2046  # the 4- and 8-GPU results that exist, one word each
$PY -m calibrate validate --profile "$R/profile-np2.json" $(ls -d "$R"/calib-np4 "$R"/calib-np8 2>/dev/null) \
  --min-bytes 1M --summary-only > "$R/validate-np2.txt" 2>&1
log "2-GPU profile on 4 and 8 GPUs (target: median error <= 10% from 1 MiB):"; cat "$R/validate-np2.txt" | tee -a "$SUMMARY"

# 2. the interpreter against NCCL on NP GPUs: every program that fits (ring, all-pairs, recursive
#    halving-doubling, two-step alltoall, and hierarchical allreduce compiled as 2 x 4)
mkdir -p "$R/interp" "$R/progs"
$PY -m kernels compile hierarchical_allreduce --ranks "$NP" --nodes 2 -o "$R/progs/hierarchical_allreduce_2x4.xml" \
  > "$R/progs/compile.log" 2>&1
cp "$R"/progs/*.xml "${COMMTUNE_MSCCL_DIR:-$R/progs}/" 2>/dev/null
mpi "$NP" $PY tests/gpu/interp_check.py "$R/interp" > "$R/interp/log.txt" 2>&1
log "interpreter np=$NP: exit $?"; tail -20 "$R/interp/log.txt"

# 3. resharding on real meshes (NCCL backend, every strategy): (1,4)->(1,4) and (2,2)->(2,2)
mkdir -p "$R/reshard"
mpi "$NP" $PY -m autotune reshard --execute nccl --shape 256,1024,256 --devices-per-host 4 --solvers ensemble \
  --time-budget 0.2 --iters 5 --results "$R/reshard/reshard_gpu.json" \
  --scenario "S0RR@1,4[0,1,2,3]:S0RR@1,4[4,5,6,7]" --scenario "S0RR@1,4[0,1,2,3]:RS0R@1,4[4,5,6,7]" \
  --scenario "S01RR@2,2[0,1,4,5]:S01RR@2,2[2,3,6,7]" --scenario "S0RR@2,2[0,1,4,5]:RS1R@2,2[2,3,6,7]" \
  > "$R/reshard/log.txt" 2>&1
log "reshard np=$NP: exit $?"; tail -15 "$R/reshard/log.txt"

# 4. strategy validation at NP GPUs: >= 8 plans of a GPT layer, Spearman >= 0.9
mkdir -p "$R/sbp"
mpi "$NP" $PY -m autotune validate --backend nccl --nodes 1 --gpus-per-node "$NP" --plans 10 --mode graph \
  --dtype float16 --hidden 4096 --heads 32 --sequence 2048 --batch 8 --micro-batch 8 --out "$R/sbp" \
  > "$R/sbp/validate.txt" 2>&1
log "autotune validate np=$NP: exit $? $(grep -i spearman "$R/sbp/validate.txt" | tail -1)"

tar -czf "$OUT/gpu8-results.tar.gz" -C "$OUT" results8
echo; echo "==================== summary ===================="; cat "$SUMMARY"
