#!/usr/bin/env bash
# GPU check of stock NCCL tuned through commtune's tuner plugin (issue 17), on nvidia-h200-x2:
#   OUT=/path bash tests/gpu/nccl_check.sh          (tests/gpu/run_all.sh runs it as part "nccl")
# 1. python -m kernels build-tuner: the plugin, with the system C compiler.
# 2. python -m autotune nccl on 2 GPUs, allreduce/allgather/reducescatter/broadcast, 1 KiB..1 GiB:
#    held-out sizes declared, the sweep, the table and env file, then the arms compared at the development
#    sizes: NCCL default, NCCL_MIN_CTAS alone, the table alone, table + NCCL_MIN_CTAS, the best fixed setting.
# 2b. python -m autotune nccl evaluate $OUT/tuned: the same arms at the held-out sizes, in a fresh process
#    ($OUT/tuned/nccl_evaluate.json: the figures to quote; issue 31).
# 3. python -m calibrate run with the env file sourced (NCCL_DEBUG=INFO): the harness picks the plugin up.
# 4. A torch.distributed allreduce loop, without and with the env file (torchrun).
# 5. The report section ($OUT/nccl-report.html) and a summary.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-${1:-/tmp/nccl-check}}
PY=${PY:-python3}
TORCHRUN=${TORCHRUN:-$(dirname "$(command -v $PY)")/torchrun}
[ -x "$TORCHRUN" ] || TORCHRUN=$(command -v torchrun || echo torchrun)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MPIRUN="mpirun --allow-run-as-root -np 2 -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -x PYTHONPATH"
mkdir -p "$OUT"
PLUGIN=$OUT/libnccl-tuner-commtune.so
rc_all=0

$PY -m kernels build-tuner --out "$PLUGIN" > "$OUT/build.log" 2>&1
echo "build-tuner: exit $? ($(cat "$OUT/build.log"))"

t0=$(date +%s)
timeout 480 $MPIRUN $PY -m autotune nccl --plugin "$PLUGIN" --collectives allreduce,allgather,reducescatter,broadcast \
  --sizes 1K:1G:2 --out "$OUT/tuned" > "$OUT/tune.log" 2> "$OUT/tune.err"
rc_tune=$?
echo "autotune nccl: exit $rc_tune, $(( $(date +%s) - t0 )) s wall (mpirun start to end)"
tail -4 "$OUT/tune.err"
grep '^#' "$OUT/tune.log" | tail -8
[ $rc_tune -eq 0 ] || rc_all=1

t0=$(date +%s)
timeout 240 $MPIRUN $PY -m autotune nccl evaluate "$OUT/tuned" --plugin "$PLUGIN" > "$OUT/evaluate.log" \
  2> "$OUT/evaluate.err"
rc_eval=$?
echo "autotune nccl evaluate: exit $rc_eval, $(( $(date +%s) - t0 )) s wall"
tail -3 "$OUT/evaluate.err"
grep '^#' "$OUT/evaluate.log" | tail -8
[ $rc_eval -eq 0 ] || rc_all=1
[ -f "$OUT/tuned/nccl_evaluate.json" ] && $PY -m reports tables "$OUT/tuned/nccl_evaluate.json" > "$OUT/evaluate.md"

if [ -f "$OUT/tuned/nccl_tuner.env" ]; then
  ENVX="-x NCCL_TUNER_PLUGIN -x COMMTUNE_NCCL_TUNER_TABLE -x NCCL_MIN_CTAS -x NCCL_DEBUG -x NCCL_DEBUG_SUBSYS"
  (
    set -a; . "$OUT/tuned/nccl_tuner.env"; set +a
    export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,ENV
    timeout 150 $MPIRUN $ENVX $PY -m calibrate run --backend nccl --mode graph --groups world \
      -c allreduce,allgather,reducescatter,broadcast -b 1K -e 1G -f 4 --check --out "$OUT/calib-tuned"
  ) > "$OUT/calib-tuned.log" 2>&1
  rc_cal=$?
  n_table=$(grep -c "commtune NCCL tuner: table" "$OUT/calib-tuned.log")
  n_nccl=$(grep -c "Successfully loaded external tuner plugin\|TUNER/Plugin: Using commtune" "$OUT/calib-tuned.log")
  echo "calibrate run with the env file: exit $rc_cal; plugin log lines: $n_table (plugin: table read), $n_nccl (NCCL: loaded)"
  [ $rc_cal -eq 0 ] && [ "$n_table" -gt 0 ] || rc_all=1

  timeout 90 "$TORCHRUN" --nproc-per-node 2 tests/gpu/nccl_torch_loop.py "$OUT/torch-default.json" \
    > "$OUT/torch-default.log" 2>&1
  echo "torch loop, NCCL default: exit $?"
  (
    set -a; . "$OUT/tuned/nccl_tuner.env"; set +a
    export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING
    timeout 90 "$TORCHRUN" --nproc-per-node 2 tests/gpu/nccl_torch_loop.py "$OUT/torch-tuned.json" --plugin "$PLUGIN"
  ) > "$OUT/torch-tuned.log" 2>&1
  rc_torch=$?
  n_torch=$(grep -c "commtune NCCL tuner: table" "$OUT/torch-tuned.log")
  echo "torch loop with the env file: exit $rc_torch; plugin log lines: $n_torch; $(grep 'plugin decided' "$OUT/torch-tuned.log")"
  [ $rc_torch -eq 0 ] && [ "$n_torch" -gt 0 ] || rc_all=1
fi

# shellcheck disable=SC2046  # the evaluation record where one was written: no word at all otherwise
$PY -m reports "$OUT/tuned/nccl_tune.json" $(ls "$OUT/tuned/nccl_evaluate.json" 2>/dev/null) -o "$OUT/nccl-report.html" > "$OUT/report.log" 2>&1 \
  || echo "report: failed (see report.log)"

$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    from autotune.nccl.record import TuneRecord, summary
    rec = TuneRecord.load(out / "tuned/nccl_tune.json")
except Exception as e:
    print(f"no record: {e}"); sys.exit(0)
print(f"seconds: { {k: round(v, 1) for k, v in rec.seconds.items()} }; plugin counters {rec.plugin_counters}")
print("table:", *rec.table_rows, sep="\n  ")
for coll, s in summary(rec.compare).items():
    print(f"{coll} (development): geomean {s['geomean']} worst {s['worst']} at {s['worst_bytes']} largest "
          f"{s['largest_ratio']} #wrong {s['wrong']} arms over default {s['against_default']} targets {s['targets']}")
try:
    from autotune.nccl.record import EvaluateRecord
    ev = EvaluateRecord.load(out / "tuned/nccl_evaluate.json")
    for coll, s in summary(ev.compare).items():
        print(f"{coll} (EVALUATION, held-out {s['points']} sizes): geomean {s['geomean']} worst {s['worst']} "
              f"#wrong {s['wrong']} arms over default {s['against_default']} tuned over arms {s['tuned_over']} "
              f"targets {s['targets']}")
except Exception as e:
    print(f"no evaluation record: {e}")
calib = out / "calib-tuned/stats.csv"
if calib.exists():
    import pandas as pd
    st = pd.read_csv(calib)
    print("calibrate run (tuned): #wrong", int(st["wrong"].clip(lower=0).sum()), "rows", len(st))
def load(name):
    try:
        return {r["bytes"]: r for r in json.loads((out / name).read_text())["rows"]}
    except (OSError, ValueError, KeyError):
        return {}
d, t = load("torch-default.json"), load("torch-tuned.json")
for n in sorted(set(d) & set(t)):
    print(f"torch allreduce {n:>10} B: default {d[n]['median_us']:9.2f} us, tuned {t[n]['median_us']:9.2f} us, "
          f"ratio {d[n]['median_us'] / t[n]['median_us']:.3f}, #wrong {d[n]['wrong'] + t[n]['wrong']}")
PYEOF
exit $rc_all
