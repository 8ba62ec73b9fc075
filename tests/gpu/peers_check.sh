#!/usr/bin/env bash
# GPU part "peers" (issue 19), on nvidia-h200-x2, one process per GPU:
#   OUT=/path bash tests/gpu/peers_check.sh          (tests/gpu/run_all.sh runs it as part "peers")
# 1. python -m kernels peers: the interpreter's tuned table, NCCL default, NCCL symmetric kernels on
#    registered windows, torch SymmetricMemory one-shot / two-shot / reduce_scatter_out / low-contention
#    (copy engines); allreduce, allgather, reducescatter 1 KiB..1 GiB; every result checked.
# 2. Candidate tables (two-shot allreduce; LL128) beside the shipped table and NCCL, a process each.
# 3. NCCL's environment sweep (channels 16/32/64 x LL/LL128/Simple), one process per setting, and
#    NCCL with commtune's tuner plugin when part "nccl" ran first (its env file).
# 4. The merged table: NCCL's best setting and the best peer per size, our ratio, the targets.
# 5. The tensor-parallel MLP step: the interpreter's allreduce against torch's NCCL allreduce.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-${1:-/tmp/peers-check}}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MPIRUN="mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED -x PYTHONPATH"
SIZES=${PEERS_SIZES:---min-bytes 1K --max-bytes 1G --factor 4}
[ -d build/msccl ] && export COMMTUNE_MSCCL_DIR=$PWD/build/msccl
export COMMTUNE_MSCCL_DIR=${COMMTUNE_MSCCL_DIR:-}
mkdir -p "$OUT/nccl-sweep"

t0=$(date +%s)
# shellcheck disable=SC2086  # SIZES and MPIRUN are word lists
timeout 150 $MPIRUN $PY -m kernels peers $SIZES --out "$OUT/peers.json" < /dev/null > "$OUT/peers.log" 2>&1
echo "peers: exit $?, $(($(date +%s) - t0)) s"
grep -E "^peer |WRONG" "$OUT/peers.log"

# LL128 on every program (float32 and bfloat16, sizes not dividing the tile), equal to NCCL
t1=$(date +%s)
# shellcheck disable=SC2086
timeout 90 $MPIRUN -x COMMTUNE_MSCCL_DIR $PY tests/gpu/interp_check.py "$OUT/ll128" --ll128 --quick \
  < /dev/null > "$OUT/ll128-check.log" 2>&1
echo "LL128 check: exit $?, $(($(date +%s) - t1)) s; $(grep -E "^LL128 correctness" "$OUT/ll128-check.log")"
grep -m5 WRONG "$OUT/ll128-check.log"

# candidate tables (new paths: the selection may take one only after a run like this validated it),
# each in its own process beside the shipped table and NCCL, so that a failure costs nothing else
mkdir -p "$OUT/candidates"
for cand in ${PEERS_CANDIDATES:-h200x2-twoshot h200x2-ll128 h200x2-twoshot-ll128}; do
  t1=$(date +%s)
  colls=allreduce,allgather,reducescatter
  case $cand in *twoshot*) colls=allreduce ;; esac
  # shellcheck disable=SC2086
  timeout 60 $MPIRUN $PY -m kernels peers --peers interp,nccl --collectives $colls --candidates "$cand" $SIZES \
    --out "$OUT/candidates/$cand.json" < /dev/null > "$OUT/candidates/$cand.log" 2>&1
  echo "candidate $cand: exit $?, $(($(date +%s) - t1)) s"
  grep -E "^peer |WRONG" "$OUT/candidates/$cand.log"
done

t1=$(date +%s)
$PY -m kernels peers --nccl-settings | while read -r a b c label; do
  name=${label//\//_}
  # shellcheck disable=SC2086
  env "$a" "$b" "$c" timeout 40 $MPIRUN -x NCCL_MIN_NCHANNELS -x NCCL_MAX_NCHANNELS -x NCCL_PROTO \
    $PY -m kernels peers --peers nccl --label "$label" $SIZES --reps 5 \
    --out "$OUT/nccl-sweep/$name.json" < /dev/null > "$OUT/nccl-sweep/$name.log" 2>&1
  echo "nccl $label: exit $?"
done
echo "nccl sweep: $(($(date +%s) - t1)) s"
# NCCL with commtune's tuner plugin, when part "nccl" (run before this one) wrote its env file
TUNED_ENV=${PEERS_NCCL_TUNED_ENV:-$OUT/../nccl/tuned/nccl_tuner.env}
if [ -f "$TUNED_ENV" ]; then
  (
    set -a
    # shellcheck disable=SC1090
    . "$TUNED_ENV"
    set +a
    # shellcheck disable=SC2086
    timeout 40 $MPIRUN -x NCCL_TUNER_PLUGIN -x COMMTUNE_NCCL_TUNER_TABLE -x NCCL_MIN_CTAS \
      $PY -m kernels peers --peers nccl --label tuned $SIZES --reps 5 --out "$OUT/nccl-sweep/tuned.json" \
      < /dev/null > "$OUT/nccl-sweep/tuned.log" 2>&1
  )
  echo "nccl with the tuner plugin ($TUNED_ENV): exit $?"
else
  echo "nccl with the tuner plugin: skipped ($TUNED_ENV absent: run part nccl first)"
fi

records=()
for f in "$OUT/peers.json" "$OUT"/candidates/*.json "$OUT"/nccl-sweep/*.json; do
  [ -s "$f" ] && records+=("$f")
done
$PY -m kernels peers --merge "${records[@]}" --out "$OUT/peers-merged.json" > "$OUT/peers-table.txt" 2>&1
echo "merge: exit $?"
cat "$OUT/peers-table.txt"

t2=$(date +%s)
# shellcheck disable=SC2086
timeout 90 $MPIRUN $PY -m kernels tp-mlp --out "$OUT/tp-mlp.json" < /dev/null > "$OUT/tp-mlp.log" 2>&1
echo "tp-mlp: exit $?, $(($(date +%s) - t2)) s"
tail -12 "$OUT/tp-mlp.log"
echo "peers part: $(($(date +%s) - t0)) s in all"
