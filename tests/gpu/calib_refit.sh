#!/usr/bin/env bash
# After a GPU run of part calibrate (tests/gpu/calib_check.sh): keep its raw runs as a record and refit
# the embedded H200 profiles from them, with the random-size errors in their provenance. On any machine:
#
#   bash tests/gpu/calib_refit.sh RESULTS [RECORD]
#
# RESULTS: the run's results folder (run_all.sh's $OUT/results, unpacked from gpu-results.tar.gz), holding
#          calib-graph/ calib-host/ random-graph/ random-host/
# RECORD:  where the raw runs are kept (default reports/records/calib-h200x2-adaptive)
# Writes calibrate/profiles/h200-nvlink.json and h200-nvlink-host.json (their compute sections kept),
# recombines the default h200-nvlink+ib400 (intra tier from h200-nvlink), refits the interpreter cost
# model's parameters (kernels/interp/fitted/interp_model.json: its link betas come from that profile) on
# their own record, and prints the targets table of the refitted profiles against the random sizes.
set -euo pipefail
src=${1:?give the results folder of the GPU run (with calib-graph/ calib-host/ random-graph/ random-host/)}
rec=${2:-reports/records/calib-h200x2-adaptive}
PY=${PY:-python3}
for d in calib-graph calib-host random-graph random-host; do
  [ -f "$src/$d/stats.csv" ] || { echo "calib_refit.sh: error: $src/$d/stats.csv is missing: give the results folder of part calibrate" >&2; exit 2; }
done
mkdir -p "$rec"
for d in calib-graph calib-host random-graph random-host random-separate-graph random-separate-host; do
  rm -rf "${rec:?}/$d"
  [ -d "$src/$d" ] && cp -r "$src/$d" "$rec/$d"
done
for f in targets.txt calib-graph.log calib-host.log fit-graph.txt fit-host.txt random-separate-graph.txt \
         random-separate-host.txt; do
  [ -f "$src/$f" ] && cp "$src/$f" "$rec/gpu-$f"
done
when=$(date -u +%Y-%m-%d)
for mode in graph host; do
  name=h200-nvlink; [ $mode = host ] && name=h200-nvlink-host
  $PY -m calibrate fit "$rec/calib-$mode" --validation "$rec/random-$mode" --name $name --link-peak 478 \
    --compute-from $name -o calibrate/profiles/$name.json --quiet \
    --note "2 x H200 on NVLink (nvidia-h200-x2), $mode timing; adaptive sweep (calibrate run --refine) with 32 random sizes per collective measured in the same run (--random) by tests/gpu/calib_check.sh; refitted $when by tests/gpu/calib_refit.sh; raw runs in $rec" \
    > "$rec/fit-$mode.txt"
  cat "$rec/fit-$mode.txt"
done
$PY -m calibrate profiles --combine h200-nvlink ib400 --name h200-nvlink+ib400 -o calibrate/profiles/h200-nvlink+ib400.json
# the interpreter cost model takes its link betas from the default profile: refit it on its own record
interp=kernels/interp/fitted/interp_model.json
sweep=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['provenance']['source'])" $interp)
$PY -m autotune schedule --fit-model "$sweep" --profile h200-nvlink+ib400 > "$interp.new" && mv "$interp.new" $interp
$PY tests/gpu/calib_targets.py "$rec" --profile graph=calibrate/profiles/h200-nvlink.json \
  --profile host=calibrate/profiles/h200-nvlink-host.json | tee "$rec/targets-refit.txt"
