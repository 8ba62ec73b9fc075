#!/usr/bin/env bash
# Issue 26's development loop on one GPU (no held-out shape is run): python -m calibrate compute into
# $OUT/profile.json, then tests/gpu/transformer_check.py on the development rows of every shape declaration
# (reports/records/transformer_shapes*.json; RECOMPUTE modes, default "none"), then
# tests/gpu/transformer_profile.py for PROFILE_IDS ("FILE:ID,ID:RECOMPUTE FILE:ID:RECOMPUTE ...", FILE a
# declaration's name without .json; PROFILE_ARGS passes options, e.g. "--memory"). Everything under a timeout.
#   run(command="OUT=$OUT PROFILE_IDS='transformer_shapes_dev3:D9:none' bash tests/gpu/transformer_dev.sh")
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUT=${OUT:-${1:-out}}
PY=${PY:-python3}
mkdir -p "$OUT"
t0=$SECONDS
timeout "${COMPUTE_TIMEOUT:-240}" $PY -m calibrate compute --profile "${BASE_PROFILE:-h200-nvlink}" \
  --out "$OUT/profile.json" --iters 10 --warmup 2 > "$OUT/compute.log" 2>&1
rc=$?
echo "calibrate compute: exit $rc ($((SECONDS - t0)) s)"
grep -E "^\[compute\] (layers|memory |NVIDIA)" "$OUT/compute.log" | tail -4
[ $rc -eq 0 ] || { tail -5 "$OUT/compute.log"; exit 1; }
for decl in reports/records/transformer_shapes*.json; do
  name=$(basename "$decl" .json)
  for rec in ${RECOMPUTE:-none}; do
    t1=$SECONDS
    timeout "${CHECK_TIMEOUT:-150}" $PY tests/gpu/transformer_check.py "$OUT/profile.json" --shapes "$decl" \
      --sets development --recompute "$rec" --out "$OUT/$name-$rec.json" > "$OUT/$name-$rec.txt" 2>&1
    echo "transformer check $name (recompute $rec): exit $? ($((SECONDS - t1)) s)"
    grep -E "^(D[0-9]|shape|development)" "$OUT/$name-$rec.txt"
  done
done
for item in ${PROFILE_IDS:-}; do
  IFS=: read -r name ids rec <<< "$item"
  t1=$SECONDS
  # shellcheck disable=SC2086
  timeout "${PROFILE_TIMEOUT:-120}" $PY tests/gpu/transformer_profile.py "$OUT/profile.json" \
    --shapes "reports/records/$name.json" --ids "$ids" --recompute "${rec:-none}" ${PROFILE_ARGS:-} \
    > "$OUT/profile-$name-${ids//,/_}-${rec:-none}.txt" 2>&1
  echo "transformer profile $item: exit $? ($((SECONDS - t1)) s)"
done
echo "development run: $((SECONDS - t0)) s"
