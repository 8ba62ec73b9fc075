#!/usr/bin/env bash
# Part "transformer" of tests/gpu/run_all.sh (issue 26's one-GPU target; one GPU, no mpirun):
#   1. python -m calibrate compute on this machine into $OUT/profile.json (the base profile's tiers kept;
#      its compute section, SDPA grid and device memory measured here);
#   2. tests/gpu/transformer_check.py with that profile: the declared shapes
#      (reports/records/transformer_shapes.json) run as plain nn.Modules, measured beside the planner's
#      prediction; the table in $OUT/transformer-<recompute>.txt, the rows in .json;
#   3. python -m calibrate compute evaluate at the held-out shapes of reports/records/compute_heldout_*.json
#      (issue 31; EVALUATE=0 skips it);
#   4. tests/gpu/transformer_apply.sh: the searched plans of D3 and H4 executed through autotune.apply
#      beside the prediction (issue 27; APPLY=0 skips it).
# Run from the repository root, e.g. run(command="PARTS=transformer bash tests/gpu/run_all.sh") on
# nvidia-h100-x1 or nvidia-h200, or directly: OUT=/path bash tests/gpu/transformer_check.sh
# RECOMPUTE (default "none full"): once as is, once with torch.utils.checkpoint per block; CHECK_ARGS passes
# options to the check (e.g. "--sets development" or "--ids D1,H4"). Every command is under a timeout
# (COMPUTE_TIMEOUT, CHECK_TIMEOUT per recomputation mode, seconds: together within one 10-minute
# device call by default).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUT=${OUT:-${1:-out}}
PY=${PY:-python3}
BASE=${BASE_PROFILE:-h200-nvlink}
mkdir -p "$OUT"
t0=$SECONDS
timeout "${COMPUTE_TIMEOUT:-240}" $PY -m calibrate compute --profile "$BASE" --out "$OUT/profile.json" --iters 10 \
  --warmup 2 > "$OUT/compute.log" 2>&1
rc=$?
echo "calibrate compute: exit $rc ($((SECONDS - t0)) s)"
grep -E "^\[compute\] (sdpa (bf16|fp32):|NVIDIA|memory )" "$OUT/compute.log" | tail -5
if [ $rc -ne 0 ]; then
  tail -5 "$OUT/compute.log"
  echo "transformer check: no profile measured on this machine, nothing predicted"
  exit 1
fi
for rec in ${RECOMPUTE:-none full}; do
  t1=$SECONDS
  # shellcheck disable=SC2086
  timeout "${CHECK_TIMEOUT:-170}" $PY tests/gpu/transformer_check.py "$OUT/profile.json" --recompute "$rec" \
    --out "$OUT/transformer-$rec.json" ${CHECK_ARGS:-} > "$OUT/transformer-$rec.txt" 2>&1
  echo "transformer check (recompute $rec): exit $? ($((SECONDS - t1)) s)"
  cat "$OUT/transformer-$rec.txt"
done
# 3. the compute model's confirmatory evaluation (issue 31): the held-out shapes declared in the records, measured
#    in a fresh process beside this run's profile (EVALUATE=0 skips it)
if [ "${EVALUATE:-1}" = 1 ]; then
  t1=$SECONDS
  timeout "${EVAL_TIMEOUT:-150}" $PY -m calibrate compute evaluate --heldout reports/records/compute_heldout_2026-11-27.json \
    --profile "$OUT/profile.json" --out "$OUT/compute_eval.json" > "$OUT/compute_eval.log" 2>&1
  echo "calibrate compute evaluate: exit $? ($((SECONDS - t1)) s)"
  [ -f "$OUT/compute_eval.json" ] && $PY -m reports tables "$OUT/compute_eval.json" > "$OUT/compute_eval.md" 2>&1 \
    && tail -20 "$OUT/compute_eval.md"
fi
# 4. issue 27: the searched plans of D3 and H4 through autotune.apply on the reference modules, beside the
#    prediction, with this run's profile (APPLY=0 skips it)
if [ "${APPLY:-1}" = 1 ]; then
  profile="$OUT/profile.json"
  OUT="$OUT/apply" PROFILE="$profile" PY=$PY bash tests/gpu/transformer_apply.sh
fi
echo "transformer part: $((SECONDS - t0)) s"
