#!/usr/bin/env bash
# Part "calibrate" of tests/gpu/run_all.sh (2 GPUs, one process per GPU): for graph and host timing,
#   1. one calibrate run: the sweep 1.375 KiB..704 MiB by x2 for the six collectives (--check) and, in the
#      same run, 32 sizes per collective drawn at random between 1 KiB and 1 GiB (--random: not on the grid,
#      each measured in turn with the sweep's sizes, checked as they are, into random-<mode>/, which no fit
#      reads); then --refine (the steps of all curves bisected to 1/32 octave under one budget, 30% of the
#      sweeps' time);
#   2. the fit into a profile (segments at the located steps), judged on the random sizes (fit --validation);
#   3. the same random sizes measured again in a process of their own (calibrate validate --random --check,
#      random-separate-<mode>/): how far two runs of the same sizes differ, beside the model's error;
# then the targets table (tests/gpu/calib_targets.py). Writes under $OUT:
#   calib-<mode>/ (results dir: stats.csv, points.csv, refine.json), random-<mode>/, profile-<mode>.json,
#   fit-<mode>.txt (with the random sizes' table), random-separate-<mode>/ and .txt, targets.txt.
# $PACK_CMD (from run_all.sh) packs the results after each step.
# The sweep's sizes are 11 * 2^k (1408 B, 2816 B, ... 704 MiB) moved to odd multiples of 512 B (--size-unit
# 256 per rank): NCCL runs sizes aligned to 8 KiB up to 8% faster at 48-250 KiB than the sizes around them
# (run of 2026-11-23 09:15, reports/records/calibrate.md), and users' sizes, like the random ones judged
# here (multiples of 512 B), are mostly not. --bind-to none: bound to one core (mpirun's default for 2
# ranks), a rank shares it with its NCCL and CUDA threads, and host-mode times at small sizes jumped by
# 20-50% between neighbouring sizes and between runs.
# Each mpirun is under a timeout: a cut-short run keeps what it measured (resumable) and the rest goes on.
set -u
: "${OUT:?set OUT to the results folder}"
PY=${PY:-python3}
# CALIB_MPI, CALIB_BACKEND, CALIB_MODES and CALIB_MAX let the same script run on CPUs (mpich, --backend mpi)
source "$(dirname "$0")/mpi.sh"
MPI=${CALIB_MPI:-$(mpi_cmd 2 NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS PYTHONUNBUFFERED \
  PYTHONPATH)}
FAILED=0
BACKEND=${CALIB_BACKEND:-nccl}
MAX=${CALIB_MAX:-1G}
REPS=${CALIB_REPS:-11}        # timed batches per size
RANDOM_N=${CALIB_RANDOM:-32}
SEED=${CALIB_SEED:-1}
SWEEP_TIMEOUT=${CALIB_SWEEP_TIMEOUT:-240}
VALIDATE_TIMEOUT=${CALIB_VALIDATE_TIMEOUT:-90}
pack() { eval "${PACK_CMD:-true}"; }
for mode in ${CALIB_MODES:-graph host}; do
  t0=$(date +%s)
  timeout $SWEEP_TIMEOUT $MPI $PY -m calibrate run --backend $BACKEND --mode $mode -b 1408 -e $MAX -f 2 --reps $REPS \
    --size-unit 256 --check --random $RANDOM_N --random-seed $SEED --random-min-bytes 1K --random-max-bytes $MAX \
    --random-out "$OUT/random-$mode" --refine --out "$OUT/calib-$mode" > "$OUT/calib-$mode.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || FAILED=1
  t1=$(date +%s)
  wrong=$(cat "$OUT/calib-$mode/stats.csv" "$OUT/random-$mode/stats.csv" 2>/dev/null \
    | awk -F, '$1 != "group" && $NF > 0 {s += $NF} END {print s + 0}')
  echo "calibrate $mode: sweep, $RANDOM_N random sizes per collective and refinement, exit $rc in $((t1 - t0)) s (#wrong total: $wrong)"
  grep "refined points" "$OUT/calib-$mode.log" | sed 's/^/  /'
  pack
  $PY -m calibrate fit "$OUT/calib-$mode" --validation "$OUT/random-$mode" -o "$OUT/profile-$mode.json" \
    --name "h200-nvlink-$mode" > "$OUT/fit-$mode.txt" 2>&1
  rc=$?; [ $rc -eq 0 ] || FAILED=1
  echo "calibrate $mode: fit exit $rc"
  t2=$(date +%s)
  timeout $VALIDATE_TIMEOUT $MPI $PY -m calibrate validate --profile "$OUT/profile-$mode.json" --backend $BACKEND \
    --mode $mode --random $RANDOM_N --seed $SEED -b 1K -e $MAX --reps $REPS --check --out "$OUT/random-separate-$mode" \
    > "$OUT/random-separate-$mode.txt" 2>&1
  rc=$?; [ $rc -eq 0 ] || FAILED=1
  echo "calibrate $mode: the random sizes again in a process of their own, exit $rc in $(( $(date +%s) - t2 )) s"
  pack
done
$PY tests/gpu/calib_targets.py "$OUT" | tee "$OUT/targets.txt"
exit $FAILED
