#!/usr/bin/env bash
# Issue 45 on one node of NP GPUs (NP = the GPUs nvidia-smi lists: 4 on nvidia-h200-x4, 2 on the nvidia-h200-x2
# fallback; NP=... overrides), one process per GPU. One call per part, each under ~8 minutes, every launcher
# under its own timeout (a cut-short step keeps what it measured and the next one goes on):
#   PARTS=calibrate      OUT=$OUT bash tests/gpu/collectives4_check.sh   # ~4 min
#   PARTS="interp peers" OUT=$OUT bash tests/gpu/collectives4_check.sh   # ~7 min
#   PARTS=nccl           OUT=$OUT bash tests/gpu/collectives4_check.sh   # ~6 min
#   PARTS=reshard        OUT=$OUT bash tests/gpu/collectives4_check.sh   # ~20 s a shape on 2 GPUs (RESHARD_SHAPES)
# The ranks import mpi4py from the wheels in .whl (mpi4py, mpich: carry .whl), launched with mpich's mpiexec
# (tests/gpu/mpi.sh takes MPI_LAUNCHER).
# calibrate: calibrate run --backend nccl --mode graph on the world (and, at 4+ GPUs, the pairs inside it: a fit
#    for p = 2 beside p = NP), 1408 B..1 GiB by x2, 16 random held-out sizes per collective drawn by this run,
#    --refine (budget adapting to the steps found, later passes for steps hidden by a neighbour or a
#    coincidence), then fit --validation on the random sizes.
# interp: the interpreter's programs compiled by the GC3 compiler for NP ranks (direct_* and oneshot_*) and its
#    table tuned on this machine by the schedule tuner (python -m autotune schedule --gpus NP --space quick).
# peers: python -m kernels peers at NP ranks with that table (made first when this call has none): NCCL
#    default, NCCL symmetric kernels, torch SymmetricMemory one-shot / two-shot, NCCL's channel x protocol
#    settings (one process each: NCCL's best setting per size in the merge) and NCCL with the tuner plugin
#    where the nccl part ran in this $OUT; every result checked before and after timing.
# nccl: python -m autotune nccl (held-out confirmation inside), then evaluate at its held-out sizes in a new
#    process: a collective whose gain does not hold there is declined (nccl_tuner.evaluated.csv without it).
# reshard: cross-mesh resharding (4 GPUs: 1 -> 3, 3 -> 1, 2 -> 2, 2 -> 3 uneven; 2 GPUs: 1 -> 1, 1 -> 2,
#    2 -> 1, 2 -> 2 transposed, 63 rows: uneven), every tile checked, each task's plans beside a plain exchange
#    of the same tiles, every plan predicted by its executor's operations, each timed alone in the same run.
# Writes everything under $OUT/c4 (logs, records, profile, tables) and $OUT/c4.tar.gz; a short table last.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/c4}
R=$OUT/c4
PY=${PY:-$(command -v python3)}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
NP=${NP:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
if [ "$NP" -lt 2 ]; then echo "collectives4_check: $NP GPU(s) here; run it on nvidia-h200-x4 (or -x2)"; exit 1; fi
# pip --target leaves the wheel's lib/ out: mpich's libmpi is unpacked from the wheel itself
python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('/tmp/mpich') for w in glob.glob('.whl/mpich-*.whl')]"
LIBMPI=$(find /tmp/mpich /tmp/site -name 'libmpi.so.12' 2>/dev/null | head -1)
[ -x /tmp/site/bin/mpiexec ] && export MPI_LAUNCHER=${MPI_LAUNCHER:-/tmp/site/bin/mpiexec}
if [ -n "$LIBMPI" ]; then
  LIBDIR=$(dirname "$LIBMPI")
  export MPI4PY_LIBMPI=$LIBMPI LD_LIBRARY_PATH=$LIBDIR:${LD_LIBRARY_PATH:-}
fi
echo "$NP GPUs; launcher ${MPI_LAUNCHER:-?}; libmpi ${LIBMPI:-none found}"
export PATH=/tmp/site/bin:$PATH
# shellcheck source=tests/gpu/mpi.sh
source tests/gpu/mpi.sh
MPIRUN="$(mpi_cmd "$NP" NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS PYTHONUNBUFFERED PYTHONPATH)"
mkdir -p "$R"
FAILED=""
T0=$SECONDS
pack() { tar -czf "$OUT/c4.tar.gz" -C "$OUT" c4 2>/dev/null; }
step() {  # step NAME SECONDS COMMAND...: one launcher under a timeout, its log kept, its exit printed
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" < /dev/null > "$R/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc ($((SECONDS - t0)) s of at most $limit)"
  [ "$rc" != 0 ] && { FAILED="$FAILED $name"; echo "-- $name: last lines"; tail -5 "$R/$name.log"; }
  pack
  return 0
}
nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/gpus.txt" 2>&1; cat "$R/gpus.txt"
# shellcheck disable=SC2086
if ! timeout 60 $MPIRUN $PY -c "import mpi4py.MPI as M; print(M.COMM_WORLD.Get_size())" > "$R/launcher.log" 2>&1 \
   || [ "$(grep -cx "$NP" "$R/launcher.log")" != "$NP" ]; then
  echo "LAUNCHER FAILED: $MPIRUN"; cat "$R/launcher.log"; pack; exit 1
fi

PARTS=${PARTS:-"calibrate interp peers nccl reshard"}   # the whole list: more than one call's 10 minutes
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
PLUGIN=$R/libnccl-tuner-commtune.so
# shellcheck disable=SC2086
step build-tuner 30 $PY -m kernels build-tuner --out "$PLUGIN"
INTERP=$R/interp$NP

if has calibrate; then
# calibration at NP ranks and the fit judged on random sizes drawn in the same run
GROUPS_ARG=world,pairs; [ "$NP" = 2 ] && GROUPS_ARG=world   # at 2 ranks the pairs are the world
# shellcheck disable=SC2086
step calibrate 200 $MPIRUN $PY -m calibrate run --backend nccl --mode graph -b 1408 -e 1G -f 2 --reps 7 \
  --groups $GROUPS_ARG --size-unit 256 --check --random 16 --random-seed 49 --random-min-bytes 1K \
  --random-max-bytes 1G --random-out "$R/random" --refine --refine-cap 2 --out "$R/calib"
grep -E "refined points|steps located|phantom" "$R/calibrate.log" | tail -12
step fit 30 "$PY" -m calibrate fit "$R/calib" --validation "$R/random" -o "$R/profile$NP.json" --name "h200x$NP-graph"
fi

schedule() {  # the interpreter's programs and table for NP ranks, made on this machine by one command
  # 6 candidates a band: the model (fitted on 2 GPUs, where a one-shot program has no receive waiting on
  # another) ranks oneshot_* below direct_*; with 6 both are measured in the small bands
  # shellcheck disable=SC2086
  step schedule 150 $MPIRUN $PY -m autotune schedule --gpus "$NP" --space quick --candidates 6 \
    --collective allreduce,allgather,reducescatter --sizes 1K:1G:4 --reps 5 --out "$INTERP"
  # a table for another rank count is refused in one line naming the command
  "$PY" -c "
from kernels.interp.preset import load_preset, programs_for
try:
    programs_for(load_preset('h200x2'), $NP if $NP != 2 else 4)
except Exception as e:
    print('refused:', e)" > "$R/mismatch.txt" 2>&1; cat "$R/mismatch.txt"
}
has interp && schedule

if has peers; then
[ -f "$INTERP/manifest.json" ] || schedule
SIZES="--min-bytes 1K --max-bytes 1G --factor 4"
mkdir -p "$R/nccl-sweep"
PRESET=$INTERP/manifest.json
[ -f "$PRESET" ] || PRESET=h200x2     # the schedule did not finish: the one-line refusal is what is recorded
# shellcheck disable=SC2086
step peers 100 $MPIRUN $PY -m kernels peers --preset "$PRESET" \
  --peers interp,nccl,nccl-symm,torch-oneshot,torch-twoshot $SIZES --out "$R/peers.json"
for label in 64/LL 64/LL128 64/Simple; do   # NCCL's channel x protocol settings, one process each
  ch=${label%/*} proto=${label#*/}
  # shellcheck disable=SC2086
  NCCL_MIN_NCHANNELS=$ch NCCL_MAX_NCHANNELS=$ch NCCL_PROTO=$proto step "nccl-$ch-$proto" 30 \
    $MPIRUN $PY -m kernels peers --preset "$PRESET" --peers nccl --label "ch$ch/$proto" $SIZES --reps 5 \
    --out "$R/nccl-sweep/ch${ch}_$proto.json"
done
ENVF=$R/nccl/nccl_tuner.evaluated.env; [ -f "$ENVF" ] || ENVF=$R/nccl/nccl_tuner.env
if [ -f "$ENVF" ]; then
  set -a
  # shellcheck disable=SC1090
  . "$ENVF"
  set +a
  # shellcheck disable=SC2086
  step nccl-plugin 30 $MPIRUN $PY -m kernels peers --preset "$PRESET" --peers nccl --label tuned $SIZES --reps 5 \
    --out "$R/nccl-sweep/tuned.json"
  unset NCCL_TUNER_PLUGIN COMMTUNE_NCCL_TUNER_TABLE NCCL_MIN_CTAS
else
  echo "-- no tuned NCCL table in $R/nccl (the nccl part runs in another call): NCCL with the plugin left out"
fi
records=()
for f in "$R/peers.json" "$R"/nccl-sweep/*.json; do [ -s "$f" ] && records+=("$f"); done
[ ${#records[@]} -gt 0 ] && timeout 60 "$PY" -m kernels peers --merge "${records[@]}" --out "$R/peers-merged.json" \
  > "$R/peers-table.txt" 2>&1
pack
fi

if has nccl; then
# NCCL tuned through the plugin: rows only where confirmed at sizes not tuned on; evaluate at held-out sizes
# (3 interleaved rounds: the development comparison fits its step; evaluate declines what does not hold)
# shellcheck disable=SC2086
step nccl-tune 240 $MPIRUN $PY -m autotune nccl --plugin "$PLUGIN" --collectives allreduce,allgather,reducescatter \
  --sizes 1K:1G:8 --channels=-1,32,64 --heldout 6 --rounds 3 --out "$R/nccl"
grep -E "^# (allreduce|allgather|reducescatter)|declined|kept|dropped" "$R/nccl-tune.log" | tail -16
# shellcheck disable=SC2086
step nccl-evaluate 150 $MPIRUN $PY -m autotune nccl evaluate "$R/nccl" --plugin "$PLUGIN" --rounds 3
fi

if has reshard; then
if [ "$NP" -ge 4 ]; then
  SCEN=("RRR@1,1[0]:S0RR@1,3[1,2,3]" "S0RR@1,3[1,2,3]:RRR@1,1[0]" "S0RR@1,2[0,1]:S1RR@1,2[2,3]"
        "S0RR@1,2[0,1]:S0RR@1,3[1,2,3]")
else
  SCEN=("RRR@1,1[0]:RRR@1,1[1]" "RRR@1,1[0]:S1RR@1,2[0,1]" "S1RR@1,2[0,1]:RRR@1,1[0]" "S1RR@1,2[0,1]:RS1R@1,2[0,1]")
fi
args=(); for s in "${SCEN[@]}"; do args+=(--scenario "$s"); done
# every shape here has been seen by a model choice (collectives4.md, sessions 24-25): to judge the executor model,
# declare new held-out shapes in the record first and give them in RESHARD_SHAPES
for shape in ${RESHARD_SHAPES:-63x1024x256 111x896x80 143x704x88 287x288x56 79x832x112 351x256x48}; do
# shellcheck disable=SC2086
step "reshard-$shape" 120 $MPIRUN $PY -m autotune reshard --execute nccl --shape "${shape//x/,}" \
  --devices-per-host "$NP" --solvers ensemble --time-budget 0.2 --iters 40 "${args[@]}" \
  --results "$R/reshard$NP-$shape.json"
done
fi

echo
echo "==================== issue 45 on $NP GPUs: summary ($((SECONDS - T0)) s; parts: $PARTS) ===================="
if has calibrate; then
  echo "-- fit at 16 random sizes per collective (target: median <= 2%, max <= 5%)"
  sed -n '/error at the random sizes/,$p' "$R/fit.log" 2>/dev/null | grep -E "^ *(intra|inter) " | head -12
fi
if has peers; then
  echo "-- interpreter at $NP ranks vs the best peer (target >= 1.0x every size, 0 wrong; 1 KiB allreduce <= 5 us)"
  grep -E "^target" "$R/peers-table.txt" 2>/dev/null
  grep -E "^ +allreduce +1 KiB" "$R/peers-table.txt" 2>/dev/null
fi
if has nccl; then
  echo "-- tuned NCCL at held-out sizes (target: worst >= 0.98x and >= 1.15x somewhere, or declined)"
  grep -E "^# (allreduce|allgather|reducescatter|evaluated table|NCCL_MIN_CTAS)" "$R/nccl-evaluate.log" 2>/dev/null \
    | cut -c1-180 | grep -v "each arm over"
fi
if has reshard; then
  echo "-- resharding on $NP GPUs: executor model (target: every plan within 15%), plans vs the plain exchange"
  for log in "$R"/reshard-*.log; do
    echo "$(basename "$log" .log)"
    grep -E "^(BAD|OK .*exchange)|executor .* ms|measured / predicted" "$log" | sed -E 's/ +/ /g' | cut -c1-170
  done
fi
echo "failed steps:${FAILED:- none}"
pack
[ -z "$FAILED" ]
