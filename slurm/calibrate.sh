#!/bin/bash
# Calibrate the communication of a GPU cluster: measure every collective, fit a
# profile (alpha/beta per collective and tier) and write an HTML report.
#
#   sbatch slurm/calibrate.sh                        # on a Slurm cluster
#   sbatch --nodes=4 --time=00:30:00 slurm/calibrate.sh
#   BACKEND=mpi NP=4 bash slurm/calibrate.sh         # one machine, no Slurm (mpiexec)
#
# The #SBATCH lines below are defaults: options given to sbatch on its command
# line (or in SBATCH_* environment variables, e.g. SBATCH_TIMELIMIT) override
# them. On nodes without GPUs in Slurm's GRES, pass --gpus-per-node=0.
#
# The script's own settings come from the environment (sbatch exports the
# submitting shell's environment by default):
#   BACKEND      nccl | mpi                               (default nccl)
#   MODE         host | graph | isolated                  (default host)
#   COLLECTIVES  comma-separated list                     (default all six)
#   MIN_BYTES, MAX_BYTES, FACTOR   size sweep, whole buffer as in nccl-tests
#                                                         (default 1K, 1G, 2)
#   ITERS, WARMUP                                         (default 20, 5)
#   REFINE       1: after each collective's sweep, locate the steps of its curve
#                (NCCL's protocol switches) by bisection, within 30% of the
#                sweep's time (calibrate run --refine); 0: the sweep alone
#                                                         (default 1)
#   COMM_GROUPS  world,intra,inter                        (default: calibrate's)
#   RESULTS      results directory; the profile and report.html are written
#                inside it (default results/<job name>-<job id>, or
#                results/local-<timestamp> outside Slurm). Submitting again with
#                the same RESULTS resumes: finished points are not measured again.
#   PYTHON       interpreter with commtune installed (default .venv/bin/python of
#                the submit directory if present, else python3)
#   LAUNCHER     srun | mpiexec (default srun under Slurm, mpiexec outside)
#   SRUN_MPI     srun --mpi plugin (default auto: pmi2 when mpi4py runs on MPICH,
#                e.g. the mpich wheel, which speaks PMI-1/2 but not Slurm's PMIx;
#                pmix when it runs on Open MPI; "none" passes no --mpi option)
#   NP           ranks outside Slurm (default: number of GPUs, else 2)
#   MPIEXEC      mpiexec outside Slurm (default the one next to PYTHON, else PATH)
#   MPIEXEC_ARGS more mpiexec options, e.g. hosts and a launcher across nodes without
#                Slurm: "-hosts node0:8,node1:8 -launcher ssh"
#   LAUNCH_TIMEOUT  seconds the measurement (srun or mpiexec) may run before it is
#                stopped (default: under Slurm the job's time left less 2 minutes for
#                the fit and the report, else 24 hours)
#   REPORT       1: write report.html after the fit; 0: the profile alone (default 1)
#   EXTRA_ARGS   more arguments for `python -m calibrate run`
#
#SBATCH --job-name=commtune-calibrate
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --output=%x_%j.out

set -euo pipefail

log() { echo "calibrate.sh: $*" >&2; }
die() { echo "calibrate.sh: error: $*" >&2; exit 2; }

# Under Slurm the script runs from a copy in the spool directory: resolve
# relative paths against the directory sbatch was called from.
cd "${SLURM_SUBMIT_DIR:-$PWD}"

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON not found: set PYTHON to an interpreter with commtune installed"
"$PYTHON" -c "import calibrate" 2>/dev/null \
    || die "$PYTHON cannot import calibrate: run 'pip install -e .' in the commtune checkout or set PYTHON"

BACKEND=${BACKEND:-nccl}
MODE=${MODE:-host}
COLLECTIVES=${COLLECTIVES:-allreduce,allgather,reducescatter,alltoall,broadcast,sendrecv}
MIN_BYTES=${MIN_BYTES:-1K}
MAX_BYTES=${MAX_BYTES:-1G}
FACTOR=${FACTOR:-2}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
REFINE=${REFINE:-1}
COMM_GROUPS=${COMM_GROUPS:-}
EXTRA_ARGS=${EXTRA_ARGS:-}
REPORT=${REPORT:-1}
[[ "$REPORT" == 0 || "$REPORT" == 1 ]] || die "REPORT=$REPORT: use 1 (write report.html) or 0 (the profile alone)"
# NVLink SHARP (NVLS) stays off unless the caller asks for it.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    RESULTS=${RESULTS:-results/${SLURM_JOB_NAME:-calibrate}-${SLURM_JOB_ID}}
    LAUNCHER=${LAUNCHER:-srun}
else
    RESULTS=${RESULTS:-results/local-$(date +%Y%m%d-%H%M%S)}
    LAUNCHER=${LAUNCHER:-mpiexec}
fi

# Under Slurm, what the allocation cannot do is refused before anything starts.
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    if [[ "$nnodes" -lt 2 && ",${COMM_GROUPS,,}," == *,inter,* ]]; then
        die "COMM_GROUPS=$COMM_GROUPS measures between nodes, and the job has $nnodes node: submit with --nodes=2 or more, or leave inter out"
    fi
    if [[ "$BACKEND" == nccl ]]; then
        # tasks on this (the first) node against its GPUs: one rank per GPU
        per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}
        per_node=${per_node%%(*}
        per_node=${per_node%%,*}
        gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
        if [[ "$per_node" -gt "${gpus:-0}" ]]; then
            die "$per_node tasks per node but $gpus GPU(s) on $(hostname): submit with --ntasks-per-node=$gpus or fewer (one rank per GPU), or BACKEND=mpi"
        fi
    fi
fi

run_args=(-m calibrate run --backend "$BACKEND" --collectives "$COLLECTIVES"
          --min-bytes "$MIN_BYTES" --max-bytes "$MAX_BYTES" --factor "$FACTOR"
          --iters "$ITERS" --warmup "$WARMUP" --mode "$MODE" --check --out "$RESULTS")
[[ -n "$COMM_GROUPS" ]] && run_args+=(--groups "$COMM_GROUPS")
case "$REFINE" in
    1) run_args+=(--refine) ;;
    0) ;;
    *) die "REFINE=$REFINE: use 1 (adaptive sweep) or 0 (the geometric sweep alone)" ;;
esac
if [[ -e "$RESULTS/meta.json" ]]; then
    log "resuming into existing $RESULTS"
    run_args+=(--resume)
fi
# EXTRA_ARGS is split on whitespace on purpose: it carries several options.
# shellcheck disable=SC2206
run_args+=($EXTRA_ARGS)

if [[ -z "${LAUNCH_TIMEOUT:-}" ]]; then
    LAUNCH_TIMEOUT=86400
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        # squeue's %L: the time left, [days-][hours:]minutes:seconds, or UNLIMITED
        left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null || true)
        if [[ "$left" =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]]; then
            secs=$(( ${BASH_REMATCH[2]:-0} * 86400 + 10#${BASH_REMATCH[4]:-0} * 3600
                     + 10#${BASH_REMATCH[5]} * 60 + 10#${BASH_REMATCH[6]} - 120 ))
            [[ $secs -gt 60 ]] && LAUNCH_TIMEOUT=$secs || LAUNCH_TIMEOUT=60
        fi
    fi
fi
[[ "$LAUNCH_TIMEOUT" =~ ^[0-9]+$ && "$LAUNCH_TIMEOUT" -gt 0 ]] \
    || die "LAUNCH_TIMEOUT=$LAUNCH_TIMEOUT: give the seconds the measurement may run (a whole number > 0)"

srun_mpi_plugin() {
    local want=${SRUN_MPI:-auto}
    if [[ "$want" == auto ]]; then
        case "$("$PYTHON" -c 'from mpi4py import MPI; print(MPI.get_vendor()[0])' 2>/dev/null)" in
            MPICH*|Intel*|MVAPICH*) want=pmi2 ;;
            "Open MPI") want=pmix ;;
            *) want=none ;;
        esac
        if [[ "$want" != none ]] && ! srun --mpi=list 2>&1 | grep -qw "$want"; then
            log "srun has no mpi/$want plugin: using the cluster's MpiDefault"
            want=none
        fi
    fi
    echo "$want"
}

case "$LAUNCHER" in
    srun)
        [[ -n "${SLURM_JOB_ID:-}" ]] || die "LAUNCHER=srun needs a Slurm allocation: submit with sbatch or set LAUNCHER=mpiexec"
        plugin=$(srun_mpi_plugin)
        launch=(srun)
        [[ "$plugin" != none ]] && launch+=(--mpi="$plugin")
        # a task that fails ends the step, and the others follow within 30 s: no rank waits forever
        launch+=(--kill-on-bad-exit=1 --wait=30)
        ;;
    mpiexec)
        if [[ -z "${MPIEXEC:-}" ]]; then
            MPIEXEC=$(dirname "$(command -v "$PYTHON")")/mpiexec
            [[ -x "$MPIEXEC" ]] || MPIEXEC=mpiexec
        fi
        command -v "$MPIEXEC" >/dev/null || die "no mpiexec found: install mpich (pip install mpich) or set MPIEXEC"
        if [[ -n "${SLURM_JOB_ID:-}" ]]; then
            NP=${NP:-${SLURM_NTASKS:?}}
        elif [[ -z "${NP:-}" ]]; then
            NP=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
            [[ "$NP" -ge 1 ]] || NP=2
        fi
        # shellcheck disable=SC2206
        launch=("$MPIEXEC" ${MPIEXEC_ARGS:-} -n "$NP")
        if "$MPIEXEC" --version 2>&1 | grep -q "Open MPI" && [[ $EUID -eq 0 ]]; then
            launch+=(--allow-run-as-root)
        fi
        ;;
    *) die "LAUNCHER=$LAUNCHER is not supported: use srun or mpiexec" ;;
esac

RESUME_HINT="the sizes measured so far are kept in $RESULTS: submit again with RESULTS=$RESULTS to resume"

# Slurm ends a job whose node fails (or whose time is up) with SIGTERM to this script: the
# measurement runs in the background so that the signal is handled at once, with a clear message.
measure_pid=
on_term() {
    [[ -n "$measure_pid" ]] && kill -TERM "$measure_pid" 2>/dev/null
    die "the job was stopped while measuring (a node failed, the job was cancelled or its time ran out): $RESUME_HINT"
}
trap on_term TERM INT

log "measuring: ${launch[*]} $PYTHON ${run_args[*]}"
timeout --kill-after=30 "$LAUNCH_TIMEOUT" "${launch[@]}" "$PYTHON" "${run_args[@]}" &
measure_pid=$!
set +e
wait "$measure_pid"
rc=$?
set -e
measure_pid=
case $rc in
    0) ;;
    124|137) die "the measurement ran past LAUNCH_TIMEOUT=${LAUNCH_TIMEOUT}s and was stopped: $RESUME_HINT" ;;
    *) die "the measurement failed (${launch[0]} exit $rc; a rank's error or a lost node is printed above): $RESUME_HINT" ;;
esac
trap - TERM INT

log "fitting the profile: $RESULTS/profile.json"
"$PYTHON" -m calibrate fit "$RESULTS" -o "$RESULTS/profile.json"

if [[ "$REPORT" == 1 ]]; then
    log "writing the report: $RESULTS/report.html"
    "$PYTHON" -m reports "$RESULTS" "$RESULTS/profile.json" -o "$RESULTS/report.html"
fi
log "done: $RESULTS"
