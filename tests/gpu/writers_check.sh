#!/usr/bin/env bash
# Issue 44 on GPUs (one node, 2 GPUs or more): the commands that write take their --out lock before any
# work, a lock from another host included, every rank ending at once; execute stores its summary beside its
# records, and its report shows the replayed collectives the verdict compares beside the in-step kernel time.
#   1. python -m autotune: a small GPT plan for NGPU GPUs;
#   2. python -m autotune execute under torchrun into $OUT/x, then python -m reports $OUT/x (no --summarize);
#   3. the same into an --out locked by another host: refused (exit 2) within 30 s;
#   4. python -m autotune schedule under mpirun, measured, into $OUT/s; then into a locked --out: refused;
#   5. python -m autotune validate --seed -1 under mpirun: one line, every rank gone within 10 s.
# Run from the repository root:  OUT=$OUT/writers bash tests/gpu/writers_check.sh   (about 3 minutes)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUT=${OUT:-${1:-out}}
PY=${PY:-$(command -v python3)}
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
source "$(dirname "$0")/mpi.sh"
MPI=$(mpi_cmd "$NGPU" NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS PYTHONUNBUFFERED PYTHONPATH)
mkdir -p "$OUT"
ROWS=()
row() { ROWS+=("$(printf '%-34s %-6s %6s s  %s' "$1" "$2" "$3" "$4")"); }
lock_elsewhere() { mkdir -p "$1" && echo "otherhost 77 1700000000" > "$1/.commtune.lock"; }

t=$SECONDS
timeout 120 "$PY" -m autotune --model gpt --preset gpt2 --nodes 1 --gpus-per-node "$NGPU" --budget 5 \
  --compare none --out "$OUT/plan" > "$OUT/plan.log" 2>&1
row "search" "$?" $((SECONDS - t)) "$OUT/plan/plan.json"

t=$SECONDS
timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m autotune execute \
  "$OUT/plan/plan.json" --steps 6 --warmup 2 --out "$OUT/x" > "$OUT/x.log" 2>&1
rc=$?
timeout 120 "$PY" -m reports "$OUT/x" -o "$OUT/x.html" >> "$OUT/x.log" 2>&1
rep=$?
labels=$(grep -c "replayed comm ms (verdict)\|in-step kernel comm ms" "$OUT/x.html" 2>/dev/null)
row "execute + reports (no --summarize)" "$rc/$rep" $((SECONDS - t)) "summary.json: $([ -f "$OUT/x/summary.json" ] && echo yes || echo NO); comm labels: ${labels:-0}"

lock_elsewhere "$OUT/x-locked"
t=$SECONDS
timeout 60 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m autotune execute \
  "$OUT/plan/plan.json" --steps 6 --warmup 2 --out "$OUT/x-locked" > "$OUT/x-locked.log" 2>&1
row "execute, --out locked elsewhere" "$?" $((SECONDS - t)) "$(grep -o 'in use by process 77 on otherhost' "$OUT/x-locked.log" | head -1)"

t=$SECONDS
timeout 300 $MPI "$PY" -m autotune schedule --collective allreduce --gpus "$NGPU" --sizes 1K:1M:4 \
  --out "$OUT/s" > "$OUT/s.log" 2>&1
row "schedule (measured)" "$?" $((SECONDS - t)) "programs: $(find "$OUT/s/programs" -name '*.xml' 2>/dev/null | wc -l); manifest: $([ -f "$OUT/s/manifest.json" ] && echo yes || echo NO); lock left: $([ -e "$OUT/s/.commtune.lock" ] && echo YES || echo no)"

lock_elsewhere "$OUT/s-locked"
t=$SECONDS
timeout 60 $MPI "$PY" -m autotune schedule --collective allreduce --gpus "$NGPU" --sizes 1K:1M:4 \
  --out "$OUT/s-locked" > "$OUT/s-locked.log" 2>&1
row "schedule, --out locked elsewhere" "$?" $((SECONDS - t)) "$(grep -o 'in use by process 77 on otherhost' "$OUT/s-locked.log" | head -1)"

t=$SECONDS
timeout 30 $MPI "$PY" -m autotune validate --seed -1 > "$OUT/validate.log" 2>&1
row "validate --seed -1 (mpirun)" "$?" $((SECONDS - t)) "$(grep -c 'error' "$OUT/validate.log") error line(s)"

echo "step                               exit   time    what to check (expected: 0, 0/0, 2, 0, 2, 2; under 30 s for the refusals)"
printf '%s\n' "${ROWS[@]}"
