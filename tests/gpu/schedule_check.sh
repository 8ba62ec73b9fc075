#!/usr/bin/env bash
# GPU check of the schedule autotuner (issue 8), on nvidia-h200-x2, one process per GPU:
#   OUT=/path bash tests/gpu/schedule_check.sh          (tests/gpu/run_all.sh runs it as part "schedule")
# 1. python -m autotune schedule: allreduce 1 KiB..1 GiB, candidates ranked by the model, the best few
#    measured with the interpreter beside NCCL (CUDA graphs, CUDA events), correctness against NCCL;
#    writes $OUT/tuned/{programs/,manifest.json,nccl_tuner.conf,schedule.json,model_correction.json}.
# 2. python -m kernels bench --preset $OUT/tuned/manifest.json: the tuned table through the interpreter's
#    own selection (NCCL fallback outside its ranges), beside NCCL, into $OUT/bench-tuned/bench.json; every
#    row checked before timing and after the timed replays.
# 2b. python -m autotune schedule evaluate $OUT/tuned: at the held-out sizes the tuning run declared, in a
#    fresh process, the tuned manifest, NCCL and the best fixed configuration, medians
#    ($OUT/tuned/schedule_evaluate.json: the figures to quote; issue 31).
# 3. The report section ($OUT/schedule-report.html) and a short table of the issue's targets.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-${1:-/tmp/schedule-check}}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MPIRUN="mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x PYTHONPATH"
mkdir -p "$OUT"
COLLS=${SCHEDULE_COLLECTIVES:-allreduce}

t0=$(date +%s)
# SCHEDULE_ARGS: e.g. --model-params FILE (run_all.sh's part "model" fits them in the same call)
timeout 240 $MPIRUN $PY -m autotune schedule --collective "$COLLS" --gpus 2 --sizes 1K:1G:4 ${SCHEDULE_ARGS:-} \
  --out "$OUT/tuned" > "$OUT/tune.log" 2>&1
rc_tune=$?
t1=$(date +%s)
echo "tuning: exit $rc_tune, $((t1 - t0)) s wall (mpirun start to end)"
grep -v '^\[schedule\]' "$OUT/tune.log" | tail -20

timeout 120 $MPIRUN $PY -m kernels bench --collectives "$COLLS" --factor 4 --preset "$OUT/tuned/manifest.json" \
  --explain --out "$OUT/bench-tuned" > "$OUT/bench-tuned.log" 2>&1
rc_bench=$?
echo "bench with the tuned manifest: exit $rc_bench"

timeout 180 $MPIRUN $PY -m autotune schedule evaluate "$OUT/tuned" > "$OUT/evaluate.log" 2>&1
rc_eval=$?
echo "schedule evaluate: exit $rc_eval"
grep -v '^\[schedule\]' "$OUT/evaluate.log" | tail -8
[ -f "$OUT/tuned/schedule_evaluate.json" ] && $PY -m reports tables "$OUT/tuned/schedule_evaluate.json" > "$OUT/evaluate.md"

$PY -m reports "$OUT/tuned/schedule.json" "$OUT/bench-tuned/bench.json" -o "$OUT/schedule-report.html" \
  > "$OUT/report.log" 2>&1 || echo "report: failed (see report.log)"

$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    res = json.loads((out / "tuned/schedule.json").read_text())
except OSError:
    print("no schedule.json: the tuner failed (see tune.log)"); sys.exit(0)
print(f"measured={res['measured']} device={res['device']!r} seconds={ {k: round(v, 1) for k, v in res['seconds'].items()} }")
for c in res["collectives"]:
    s = c["summary"]
    print(f"{c['collective']}: over NCCL geomean {s.get('speedup_over_nccl_geomean')} worst {s.get('speedup_over_nccl_min')}; "
          f"over fixed {c['fixed_baseline']} geomean {s.get('speedup_over_fixed_geomean')}")
    print("  spearman per band:", [None if b["spearman"] is None else round(b["spearman"], 2) for b in c["bands"]])
    print("  corrected (leave-one-band-out):",
          [None if b["spearman_corrected"] is None else round(b["spearman_corrected"], 2) for b in c["bands"]])
    print("  table:", [(t["lo"], t["hi"], t["choice"]) for t in c["table"]])
try:
    rows = json.loads((out / "bench-tuned/bench.json").read_text())["rows"]
    print("bench with tuned manifest, speedup over NCCL per size:",
          [(r["bytes"], r["program"], round(r["speedup"], 2), r["correct"]) for r in rows])
except OSError:
    print("no bench-tuned/bench.json (see bench-tuned.log)")
PYEOF
[ $rc_tune -eq 0 ] && [ $rc_bench -eq 0 ] && [ $rc_eval -eq 0 ]
