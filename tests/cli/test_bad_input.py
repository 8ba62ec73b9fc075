"""Bad input to every command: each case must exit non-zero, quickly, with ONE error
line, last, that names the problem (and the fix), no traceback, and leave what was
already measured as it was. Progress lines (limits are checked before work, so
only errors found by the work itself follow them) and warnings may come before.

The cases run as subprocesses (``python -m ...`` from the repository root), several
at a time; "quickly" is at most ``CPU_LIMIT_S`` of CPU time (see cputime.py) and
``WALL_LIMIT_S`` of wall-clock time (a hang). Cases that need MPI ranks run under
``mpiexec -n 2`` (or 3 where the rank count is the point). A case marked ``xfail``
names who owns the fix.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPUTIME = Path(__file__).with_name("cputime.py")
MPIEXEC = Path(sys.executable).with_name("mpiexec")
CPU_LIMIT_S = 10.0
WALL_LIMIT_S = 60.0
WORKERS = 3


@dataclass
class Case:
    id: str
    argv: list[str]
    expect: str = ""              # a regular expression the error line must match (case-insensitive)
    ranks: int = 0                # > 0: under mpiexec -n ranks
    unchanged: list[str] = field(default_factory=list)  # files that must keep their content
    xfail: str = ""


def C(id, cmd, expect="", **kw):
    return Case(id, cmd.split() if isinstance(cmd, str) else cmd, expect, **kw)


RUN = "calibrate run --backend mpi -b 1K -e 4K -c allreduce --groups world --iters 2 --warmup 1 --reps 2"
RES = "{res}"       # a real 2-rank calibration (fixture)

CASES = [
    # ---- unknown commands and options ---------------------------------------------------
    C("calibrate-unknown", "calibrate frobnicate", "unknown command 'frobnicate'"),
    C("kernels-unknown", "kernels frobnicate", "unknown command 'frobnicate'"),
    C("autotune-unknown", "autotune frobnicate", "unknown command 'frobnicate'"),
    C("calibrate-fit-bad-option", "calibrate fit --bogus x", "unrecognized arguments|required"),
    C("reports-bad-option", "reports --bogus", "unrecognized arguments|required|--bogus"),
    # ---- kernels compile -------------------------------------------------------------------
    C("compile-unknown-algorithm", "kernels compile nope --ranks 4 -o {tmp}/x.xml", "invalid choice: 'nope'"),
    C("compile-ranks-zero", "kernels compile ring_allreduce --ranks 0 -o {tmp}/x.xml", "--ranks must be >= 2"),
    C("compile-ranks-one", "kernels compile ring_allreduce --ranks 1 -o {tmp}/x.xml", "--ranks must be >= 2"),
    C("compile-ranks-negative", "kernels compile ring_allreduce --ranks -4 -o {tmp}/x.xml", "--ranks must be >= 2"),
    C("compile-ranks-text", "kernels compile ring_allreduce --ranks x -o {tmp}/x.xml", "invalid int value: 'x'"),
    C("compile-ranks-float", "kernels compile ring_allreduce --ranks 1e3 -o {tmp}/x.xml", "invalid int value"),
    C("compile-ranks-huge", "kernels compile ring_allreduce --ranks 100000 -o {tmp}/x.xml", "over the compiler's limit"),
    C("compile-allpairs-huge", "kernels compile allpairs_allreduce --ranks 4096 -o {tmp}/x.xml", "limit"),
    C("compile-instances-huge", "kernels compile ring_allreduce --ranks 512 --instances 64 --sm-count 100000 "
      "-o {tmp}/x.xml", "limit"),
    C("compile-channels-zero", "kernels compile ring_allreduce --ranks 4 --channels 0 -o {tmp}/x.xml", "--channels"),
    C("compile-channels-negative", "kernels compile ring_allreduce --ranks 4 --channels -2 -o {tmp}/x.xml", "--channels"),
    C("compile-channels-over-sms", "kernels compile ring_allreduce --ranks 8 --channels 1000 -o {tmp}/x.xml",
      "thread blocks per GPU"),
    C("compile-instances-zero", "kernels compile ring_allreduce --ranks 4 --instances 0 -o {tmp}/x.xml", "--instances"),
    C("compile-nodes-zero", "kernels compile hierarchical_allreduce --ranks 8 --nodes 0 -o {tmp}/x.xml", "--nodes"),
    C("compile-nodes-misfit", "kernels compile hierarchical_allreduce --ranks 8 --nodes 3 -o {tmp}/x.xml",
      "not a multiple of --nodes"),
    C("compile-hierarchical-one-node", "kernels compile hierarchical_allreduce --ranks 8 --nodes 1 -o {tmp}/x.xml",
      "--nodes >= 2"),
    C("compile-rdh-not-power", "kernels compile rdh_allreduce --ranks 6 -o {tmp}/x.xml", "power-of-2"),
    C("compile-protocol", "kernels compile ring_allreduce --ranks 4 --protocol LL64 -o {tmp}/x.xml", "invalid choice"),
    C("compile-out-under-devnull", "kernels compile ring_allreduce --ranks 4 -o /dev/null/x.xml", "not a directory"),
    C("compile-out-is-dir", "kernels compile ring_allreduce --ranks 4 -o {tmp}", "is a directory"),
    C("compile-sm-zero", "kernels compile ring_allreduce --ranks 4 --sm-count 0 -o {tmp}/x.xml", "--sm-count"),
    C("compile-sm-text", "kernels compile ring_allreduce --ranks 4 --sm-count many -o {tmp}/x.xml", "invalid int"),
    C("compile-too-many-tb", "kernels compile allpairs_allreduce --ranks 16 --sm-count 8 -o {tmp}/x.xml",
      "too many thread blocks"),
    C("compile-no-output", "kernels compile ring_allreduce --ranks 4", "required: -o"),
    C("compile-no-ranks", "kernels compile ring_allreduce -o {tmp}/x.xml", "required: --ranks"),
    # ---- kernels check ---------------------------------------------------------------------
    C("check-missing-file", "kernels check {tmp}/nope.xml", "no such XML file"),
    C("check-directory", "kernels check {tmp}", "no such XML file"),
    C("check-random-bytes", "kernels check {files}/random.bin", "malformed or truncated XML"),
    C("check-empty", "kernels check {files}/empty.txt", "malformed or truncated XML"),
    C("check-truncated", "kernels check {files}/truncated.xml", "malformed or truncated XML"),
    C("check-json", "kernels check {files}/profile.json", "malformed|expected <algo>"),
    C("check-csv", "kernels check {files}/table.csv", "malformed|expected <algo>"),
    C("check-wrong-root", "kernels check {files}/wrong_root.xml", "expected <algo>"),
    C("check-bad-attribute", "kernels check {files}/bad_attribute.xml", "is not an integer"),
    C("check-negative-chunks", "kernels check {files}/negative.xml", "must be >= 1"),
    C("check-missing-gpu", "kernels check {files}/missing_gpu.xml", "truncated|gpu ids"),
    C("check-deadlock", "kernels check {files}/deadlock.xml", "deadlock"),
    C("check-seeds-zero", "kernels check {files}/ring.xml --seeds 0", "--seeds must be >= 1"),
    C("check-seeds-negative", "kernels check {files}/ring.xml --seeds -1", "--seeds must be >= 1"),
    C("check-seeds-text", "kernels check {files}/ring.xml --seeds x", "invalid int"),
    C("check-sm-zero", "kernels check {files}/ring.xml --sm-count 0", "--sm-count"),
    C("check-too-few-sms", "kernels check {files}/ring8x4.xml --sm-count 2", "too many thread blocks"),
    # ---- kernels bench (its options are checked before a GPU is looked for) -----------------
    C("bench-reps-zero", "kernels bench --reps 0", "--reps must be >= 1"),
    C("bench-unknown-preset", "kernels bench --preset nope", "no interpreter preset 'nope'"),
    C("bench-factor-one", "kernels bench --factor 1", "--factor must be above 1"),
    C("bench-min-zero", "kernels bench --min-bytes 0", "sizes must be positive"),
    C("bench-min-over-max", "kernels bench --min-bytes 1G --max-bytes 1K", "larger than --max-bytes"),
    C("bench-size-text", "kernels bench --max-bytes lots", "bad size 'lots'"),
    C("bench-collective", "kernels bench --collectives allreduse", "unknown collective 'allreduse'"),
    C("bench-out-under-devnull", "kernels bench --out /dev/null/x", "not a directory"),
    C("bench-no-gpu", "kernels bench", "GPU|cupy"),
    # ---- calibrate run: options (one process: checked before the rank count) ---------------
    C("run-iters-zero", "calibrate run -n 0", r"--iters \(-n\) must be >= 1"),
    C("run-iters-negative", "calibrate run -n -3", r"--iters \(-n\) must be >= 1"),
    C("run-iters-text", "calibrate run -n many", "invalid int"),
    C("run-warmup-negative", "calibrate run -w -1", "--warmup"),
    C("run-reps-zero", "calibrate run --reps 0", "--reps must be >= 1"),
    C("run-min-batch-negative", "calibrate run --backend mpi --min-batch-ms -1", "--min-batch-ms must not be negative"),
    C("run-random-too-many", "calibrate run --backend mpi -b 1K -e 2K --random 40",
      "--random 40: too few sizes off the sweep grid.*--random-align"),
    C("run-min-zero", "calibrate run --backend mpi -b 0", "sizes must be positive"),
    C("run-min-text", "calibrate run --backend mpi -b lots", "bad size 'lots'"),
    C("run-max-negative", "calibrate run --backend mpi --max-bytes=-1K", "bad size|expected one argument"),
    C("run-min-over-max", "calibrate run --backend mpi -b 1M -e 1K", "larger than --max-bytes"),
    C("run-factor-one", "calibrate run --backend mpi -f 1", r"--factor \(-f\) must be above 1"),
    C("run-factor-text", "calibrate run --backend mpi -f x", "invalid float"),
    C("run-dtype", "calibrate run --backend mpi -d float8", "float8"),
    C("run-bfloat16-mpi", "calibrate run --backend mpi -d bfloat16", "bfloat16 needs the nccl backend"),
    C("run-graph-mpi", "calibrate run --backend mpi -m graph", "graph timing needs GPUs"),
    C("run-mode", "calibrate run --backend mpi -m sometimes", "unknown timing mode 'sometimes'"),
    C("run-collective", "calibrate run --backend mpi -c allreduse", "allreduse"),
    C("run-collectives-empty", ["calibrate", "run", "--backend", "mpi", "-c", ","], "--collectives is empty"),
    C("run-groups", "calibrate run --backend mpi --groups planet", "planet"),
    C("run-backend", "calibrate run --backend gloo", "unknown backend 'gloo'"),
    C("run-one-rank", "calibrate run --backend mpi -b 1K -e 2K --out {tmp}/one", "one rank has nothing to measure"),
    # ---- calibrate run under MPI: limits and --resume ---------------------------------------
    C("run-max-huge", "calibrate run --backend mpi -b 1G -e 999999T --out {tmp}/huge", "GiB available", ranks=2),
    C("run-out-under-devnull", RUN + " --out /dev/null/x", "not a directory", ranks=2),
    C("run-out-is-file", RUN + " --out {files}/empty.txt", "results directory|not a directory|File exists", ranks=2),
    C("run-existing-without-resume", RUN + " --out " + RES, "add --resume", ranks=2, unchanged=["stats", "meta"]),
    C("resume-mode", RUN.replace("--reps 2", "--reps 2 -m isolated") + " --out " + RES + " --resume", "mode=",
      ranks=2, unchanged=["stats", "meta"]),
    C("resume-dtype", RUN + " -d float64 --out " + RES + " --resume", "dtype=", ranks=2, unchanged=["stats", "meta"]),
    C("resume-iters", RUN.replace("--iters 2", "--iters 3") + " --out " + RES + " --resume", "iters=", ranks=2,
      unchanged=["stats", "meta"]),
    C("resume-warmup", RUN.replace("--warmup 1", "--warmup 2") + " --out " + RES + " --resume", "warmup=", ranks=2,
      unchanged=["stats", "meta"]),
    C("resume-reps", RUN.replace("--reps 2", "--reps 3") + " --out " + RES + " --resume", "reps=", ranks=2,
      unchanged=["stats", "meta"]),
    C("resume-max-bytes", RUN.replace("-e 4K", "-e 8K") + " --out " + RES + " --resume", "sizes=", ranks=2,
      unchanged=["stats", "meta"]),
    C("resume-min-bytes", RUN.replace("-b 1K", "-b 2K") + " --out " + RES + " --resume", "sizes=", ranks=2,
      unchanged=["stats", "meta"]),
    C("resume-collectives", RUN.replace("-c allreduce", "-c allreduce,alltoall") + " --out " + RES + " --resume",
      "collectives=", ranks=2, unchanged=["stats", "meta"]),
    C("resume-groups", RUN.replace("--groups world", "--groups world,intra") + " --out " + RES + " --resume",
      "groups=", ranks=2, unchanged=["stats", "meta"]),
    C("resume-missing-dir", RUN + " --out {tmp}/never --resume", "holds no calibration to continue", ranks=2),
    C("resume-world-size", RUN + " --out " + RES + " --resume", "world_size=", ranks=3,
      unchanged=["stats", "meta"]),
    # ---- calibrate fit -----------------------------------------------------------------------
    C("fit-missing-dir", "calibrate fit {tmp}/nope -o {tmp}/p.json", "does not exist|no such"),
    C("fit-xml-file", "calibrate fit {files}/ring.xml -o {tmp}/p.json", "not a results directory|is a file"),
    C("fit-empty-dir", "calibrate fit {files}/empty_dir -o {tmp}/p.json", "meta.json"),
    C("fit-meta-malformed", "calibrate fit {files}/res_bad_meta -o {tmp}/p.json", "not valid JSON|meta.json"),
    C("fit-meta-random", "calibrate fit {files}/res_random_meta -o {tmp}/p.json", "meta.json"),
    C("fit-meta-wrong-kind", "calibrate fit {files}/res_profile_meta -o {tmp}/p.json", "calibration|kind"),
    C("fit-stats-truncated", "calibrate fit {files}/res_truncated_stats -o {tmp}/p.json", "stats.csv"),
    C("fit-stats-random", "calibrate fit {files}/res_random_stats -o {tmp}/p.json", "stats.csv"),
    C("fit-stats-empty", "calibrate fit {files}/res_empty_stats -o {tmp}/p.json", "no measurements|stats.csv"),
    C("fit-max-segments-zero", "calibrate fit " + RES + " --max-segments 0 -o {tmp}/p.json", "--max-segments"),
    C("fit-max-segments-negative", "calibrate fit " + RES + " --max-segments -2 -o {tmp}/p.json", "--max-segments"),
    C("fit-min-points-zero", "calibrate fit " + RES + " --min-points 0 -o {tmp}/p.json", "--min-points"),
    C("fit-min-points-text", "calibrate fit " + RES + " --min-points few -o {tmp}/p.json", "invalid int"),
    C("fit-out-under-devnull", "calibrate fit " + RES + " -o /dev/null/p.json", "not a directory"),
    C("fit-out-is-dir", "calibrate fit " + RES + " -o {tmp}", "is a directory"),
    C("fit-link-peak-negative", "calibrate fit " + RES + " --link-peak -5 -o {tmp}/p.json", "--link-peak"),
    C("fit-link-peak-text", "calibrate fit " + RES + " --link-peak fast -o {tmp}/p.json", "invalid float"),
    # ---- calibrate health (options and the profile checked before any exchange) ------------
    C("health-slow-one", "calibrate health --slow 1", "--slow must be a factor above 1"),
    C("health-iters-zero", "calibrate health --iters 0", r"--iters \(-n\) must be at least 1"),
    C("health-bytes-text", "calibrate health --bytes lots", "bad size 'lots'"),
    C("health-search", "calibrate health --search all", "invalid choice: 'all'"),
    C("health-unknown-profile", "calibrate health --profile nope", "nope"),
    C("health-no-intra-tier", "calibrate health --profile ib400", "no intra tier", ranks=2),
    # ---- calibrate validate --------------------------------------------------------------
    C("validate-unknown-profile", "calibrate validate --profile nope " + RES, "nope"),
    C("validate-profile-malformed", "calibrate validate --profile {files}/malformed.json " + RES, "not valid JSON"),
    C("validate-profile-random", "calibrate validate --profile {files}/random.bin " + RES, "JSON|profile"),
    C("validate-profile-wrong-kind", "calibrate validate --profile " + RES + "/meta.json " + RES, "profile"),
    C("validate-profile-string-alpha", "calibrate validate --profile {files}/string_alpha.json " + RES,
      "alpha|number"),
    C("validate-missing-results", "calibrate validate {tmp}/nope", "does not exist|no such"),
    C("validate-min-bytes-text", "calibrate validate --min-bytes lots " + RES, "bad size 'lots'"),
    C("validate-min-bytes-negative", "calibrate validate --min-bytes -1 " + RES, "bad size"),
    C("validate-truncated-results", "calibrate validate {files}/res_truncated_stats", "stats.csv"),
    # ---- calibrate profiles -----------------------------------------------------------
    C("profiles-combine-unknown", "calibrate profiles --combine nope ib400 -o {tmp}/c.json", "nope"),
    C("profiles-combine-malformed", "calibrate profiles --combine {files}/malformed.json ib400 -o {tmp}/c.json",
      "not valid JSON"),
    C("profiles-combine-out-devnull", "calibrate profiles --combine h200-nvlink ib400 -o /dev/null/c.json",
      "not a directory"),
    C("profiles-combine-no-out", "calibrate profiles --combine h200-nvlink ib400", "-o|--out"),
    C("profiles-combine-one-arg", "calibrate profiles --combine h200-nvlink", "expected 2 arguments"),
    # ---- autotune (the SBP search) -------------------------------------------------------
    C("autotune-model", "autotune --model nope", "nope"),
    C("autotune-preset", "autotune --model gpt --preset nope", "nope"),
    C("autotune-nodes-zero", "autotune --nodes 0", "--nodes"),
    C("autotune-nodes-negative", "autotune --nodes -2", "--nodes"),
    C("autotune-nodes-text", "autotune --nodes many", "invalid int"),
    C("autotune-gpus-zero", "autotune --gpus-per-node 0", "--gpus-per-node"),
    C("autotune-profile-unknown", "autotune --profile nope", "nope"),
    C("autotune-profile-malformed", "autotune --profile {files}/malformed.json", "not valid JSON"),
    C("autotune-profile-random", "autotune --profile {files}/random.bin", "JSON|profile"),
    C("autotune-profile-string-alpha", "autotune --profile {files}/string_alpha.json", "alpha|number"),
    C("autotune-search", "autotune --search annealing", "invalid choice"),
    C("autotune-budget-text", "autotune --budget soon", "budget"),
    C("autotune-budget-zero", "autotune --budget 0", "budget"),
    C("autotune-budget-negative", "autotune --budget -1", "budget"),
    C("autotune-memory-zero", "autotune --memory-limit 0", "memory"),
    C("autotune-memory-negative", "autotune --memory-limit -8", "memory"),
    C("autotune-context-parallel-text", "autotune --context-parallel some", "context-parallel"),
    C("autotune-context-parallel-divide", "autotune --context-parallel 3", "does not divide"),
    C("autotune-out-under-devnull", "autotune --out /dev/null/x", "not a directory"),
    C("autotune-layers-zero", "autotune --layers 0", "layers"),
    C("autotune-hidden-negative", "autotune --hidden -1", "hidden"),
    C("autotune-batch-zero", "autotune --batch 0", "batch"),
    C("autotune-model-json-malformed", "autotune --model {files}/malformed.json", "not valid JSON|JSON"),
    C("autotune-compare", "autotune --compare annealing", "annealing"),
    # ---- autotune validate (one process; the MPI world is that process) --------------------
    C("validate-plans-zero", "autotune validate --plans 0", "--plans"),
    C("validate-plans-negative", "autotune validate --plans -1", "--plans"),
    C("validate-plans-text", "autotune validate --plans x", "invalid int"),
    C("validate-backend", "autotune validate --backend gloo", "gloo"),
    C("validate-profile", "autotune validate --profile nope", "nope"),
    C("validate-nodes-zero", "autotune validate --nodes 0", "--nodes"),
    C("validate-gpus-misfit", "autotune validate --nodes 1 --gpus-per-node 3", "rank|world|gpus"),
    C("validate-iters-zero", "autotune validate --iters 0", "iters"),
    C("validate-mode", "autotune validate --mode sometimes", "sometimes"),
    C("validate-dtype", "autotune validate --dtype float8", "float8"),
    C("validate-out-under-devnull", "autotune validate --out /dev/null/x", "not a directory"),
    # ---- autotune reshard ------------------------------------------------------------------
    C("reshard-mesh-text", "autotune reshard --src-mesh x --src-spec S0RR --dst-mesh 2,4 --dst-spec S0RR "
      "--shape 1024,1024,512", "mesh"),
    C("reshard-mesh-zero", "autotune reshard --src-mesh 0,4 --src-spec S0RR --dst-mesh 2,4 --dst-spec S0RR "
      "--shape 1024,1024,512", "mesh"),
    C("reshard-spec-unknown", "autotune reshard --src-mesh 2,4 --src-spec S9RR --dst-mesh 2,4 --dst-spec S0RR "
      "--shape 1024,1024,512", "S9RR|spec"),
    C("reshard-spec-dims", "autotune reshard --src-mesh 2,4 --src-spec S0R --dst-mesh 2,4 --dst-spec S0RR "
      "--shape 1024,1024,512", "spec|dimension"),
    C("reshard-shape-zero", "autotune reshard --src-mesh 2,4 --src-spec S0RR --dst-mesh 2,4 --dst-spec S0RR "
      "--shape 0,1024,512", "shape"),
    C("reshard-shape-text", "autotune reshard --src-mesh 2,4 --src-spec S0RR --dst-mesh 2,4 --dst-spec S0RR "
      "--shape big", "shape"),
    C("reshard-no-dst", "autotune reshard --src-mesh 2,4 --src-spec S0RR --shape 1024,1024,512", "dst"),
    C("reshard-case", "autotune reshard --case 99", "case"),
    C("reshard-case-text", "autotune reshard --case x", "case|invalid"),
    C("reshard-pipeline", "autotune reshard --pipeline nope", "nope"),
    C("reshard-micro-batches", "autotune reshard --pipeline u-transformer-like --micro-batches 0", "micro"),
    C("reshard-profile", "autotune reshard --case 1 --profile nope", "nope"),
    C("reshard-devices-zero", "autotune reshard --src-mesh 2,4 --src-spec S0RR --dst-mesh 2,4 --dst-spec S0RR "
      "--shape 1024,1024,512 --devices-per-host 0", "devices"),
    C("reshard-mesh-misfit", "autotune reshard --src-mesh 2,4 --src-spec S0RR --dst-mesh 2,4 --dst-spec S0RR "
      "--shape 1024,1024,512 --devices-per-host 2", "devices|host|fit"),
    C("reshard-budget-negative", "autotune reshard --case 1 --time-budget -1", "budget"),
    C("reshard-rounds-zero", "autotune reshard --case 1 --rounds 0", "rounds"),
    C("reshard-plan-out-devnull", "autotune reshard --src-mesh 2,4 --src-spec S0RR --dst-mesh 2,4 --dst-spec RRR "
      "--shape 64,64,32 --devices-per-host 4 --plan-out /dev/null/p.json", "not a directory"),
    C("reshard-results-devnull", "autotune reshard --case 1 --results /dev/null/r.json", "not a directory"),
    C("reshard-jobs-negative", "autotune reshard --case 1 --jobs -1", "jobs"),
    C("reshard-strategy", "autotune reshard --case 1 --strategy teleport", "invalid choice"),
    # ---- autotune schedule -------------------------------------------------------------
    C("schedule-collective", "autotune schedule --collective allreduse --model-only --out {tmp}/s", "allreduse"),
    C("schedule-gpus-zero", "autotune schedule --gpus 0 --model-only --out {tmp}/s", "gpus"),
    C("schedule-gpus-one", "autotune schedule --gpus 1 --model-only --out {tmp}/s", "gpus"),
    C("schedule-gpus-misfit", "autotune schedule --gpus 3 --nodes 2 --model-only --out {tmp}/s", "nodes|gpus"),
    C("schedule-nodes-zero", "autotune schedule --nodes 0 --model-only --out {tmp}/s", "nodes"),
    C("schedule-gpus-huge", "autotune schedule --gpus 100000 --model-only --out {tmp}/s", "gpus|limit|ranks"),
    C("schedule-sizes-text", "autotune schedule --sizes lots --model-only --out {tmp}/s", "sizes|size"),
    C("schedule-sizes-reversed", "autotune schedule --sizes 1G:1K:4 --model-only --out {tmp}/s", "size"),
    C("schedule-candidates-zero", "autotune schedule --candidates 0 --model-only --out {tmp}/s", "candidates"),
    C("schedule-budget-renamed", "autotune schedule --budget 4 --model-only --out {tmp}/s", "--candidates"),
    C("schedule-space", "autotune schedule --space nope --model-only --out {tmp}/s", "nope"),
    C("schedule-preset", "autotune schedule --preset nope --model-only --out {tmp}/s", "nope"),
    C("schedule-profile", "autotune schedule --profile nope --model-only --out {tmp}/s", "nope"),
    C("schedule-model-params", "autotune schedule --model-params nope --model-only --out {tmp}/s", "nope"),
    C("schedule-rescore-missing", "autotune schedule --rescore {tmp}/nope.json", "does not exist|no such"),
    C("schedule-rescore-malformed", "autotune schedule --rescore {files}/malformed.json", "not valid JSON"),
    C("schedule-rescore-wrong-kind", "autotune schedule --rescore {files}/profile.json", "kind|schedule"),
    C("schedule-fit-random", "autotune schedule --fit-model {files}/random.bin", "JSON"),
    C("schedule-reps-zero", "autotune schedule --reps 0 --model-only --out {tmp}/s", "reps"),
    C("schedule-out-devnull", "autotune schedule --model-only --out /dev/null/s", "not a directory"),
    C("schedule-dtype", "autotune schedule --dtype float8 --model-only --out {tmp}/s", "invalid choice"),
    # ---- reports -------------------------------------------------------------------------
    C("reports-no-args", "reports", "required|results"),
    C("reports-missing", "reports {tmp}/nope -o {tmp}/r.html", "does not exist|no such"),
    C("reports-random", "reports {files}/random.bin -o {tmp}/r.html", "JSON"),
    C("reports-malformed", "reports {files}/malformed.json -o {tmp}/r.html", "not valid JSON|JSON"),
    C("reports-empty", "reports {files}/empty.txt -o {tmp}/r.html", "JSON|empty"),
    C("reports-csv", "reports {files}/table.csv -o {tmp}/r.html", "JSON"),
    C("reports-dir-without-meta", "reports {files}/empty_dir -o {tmp}/r.html", "meta.json"),
    C("reports-unknown-kind", "reports {files}/unknown_kind.json -o {tmp}/r.html", "kind"),
    C("reports-out-devnull", "reports " + RES + " -o /dev/null/r.html", "not a directory"),
    C("reports-out-is-dir", "reports " + RES + " -o {tmp}", "is a directory"),
    C("reports-truncated-results", "reports {files}/res_truncated_stats -o {tmp}/r.html", "stats.csv"),
    C("reports-xml", "reports {files}/ring.xml -o {tmp}/r.html", "JSON"),
    # ---- issue 44: a rank that dies before a collective, wrongly accepted models, a lock that is a folder --
    C("validate-seed-negative-mpi", "autotune validate --seed -1", "--seed: -1 is not a seed", ranks=2),
    C("autotune-hf-mixtral-as-mistral", "autotune --model {files}/mixtral_as_mistral.json --out {tmp}/o",
      "num_local_experts, num_experts_per_tok describe a mixture of experts"),
    C("autotune-hf-sequence-too-long", "autotune --model {files}/llama_2k.json --sequence 4096 --out {tmp}/o",
      "longer than the config's max_position_embeddings 2048"),
    C("autotune-lock-is-a-folder", "autotune --out {files}/lock_folder", "lock file .* is not a file"),
]


# ---- input files ----------------------------------------------------------------------------
def launch_free_environ() -> dict:
    """This process's environment less a launcher's rank variables, which an in-process test of execute
    leaves behind (its rendezvous sets RANK and WORLD_SIZE): a case started under mpiexec must see mpiexec's."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


def _python_m(*args, ranks=0, timeout=240):
    cmd = [sys.executable, "-m", *args]
    if ranks:
        cmd = [str(MPIEXEC), "-n", str(ranks), *cmd]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=launch_free_environ())


def _make_files(files: Path, res: Path) -> None:
    import random

    files.mkdir()
    rng = random.Random(20)
    (files / "random.bin").write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    (files / "empty.txt").write_text("")
    (files / "malformed.json").write_text('{"schema": "commtune.profile", "version": 1, "tiers": {')
    (files / "table.csv").write_text("a,b,c\n1,2,3\n")
    (files / "unknown_kind.json").write_text(json.dumps({"kind": "commtune.nothing", "version": 1}))
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 2048}
    (files / "llama_2k.json").write_text(json.dumps(llama))
    (files / "mixtral_as_mistral.json").write_text(json.dumps(dict(llama, architectures=["MistralForCausalLM"],
                                                                   num_local_experts=8, num_experts_per_tok=2)))
    (files / "lock_folder" / ".commtune.lock").mkdir(parents=True)
    (files / "empty_dir").mkdir()
    profile = json.loads((ROOT / "calibrate" / "profiles" / "gcp-a100.json").read_text())
    (files / "profile.json").write_text(json.dumps(profile))
    for tier in profile["tiers"].values():
        for models in tier.values():
            for model in models.values():
                for seg in model["segments"]:
                    seg["alpha"], seg["beta"] = "fast", "wide"
    (files / "string_alpha.json").write_text(json.dumps(profile))
    for name, args in (("ring.xml", ["ring_allreduce", "--ranks", "4"]),
                       ("ring8x4.xml", ["ring_allreduce", "--ranks", "8", "--channels", "4"])):
        r = _python_m("kernels", "compile", *args, "-o", str(files / name))
        assert r.returncode == 0, r.stderr
    xml = (files / "ring.xml").read_text()
    (files / "truncated.xml").write_text(xml[: len(xml) // 2])
    (files / "wrong_root.xml").write_text("<programs><algo/></programs>")
    (files / "bad_attribute.xml").write_text(re.sub(r'ngpus="\d+"', 'ngpus="four"', xml, count=1))
    (files / "negative.xml").write_text(re.sub(r'nchunksperloop="\d+"', 'nchunksperloop="-4"', xml, count=1))
    (files / "missing_gpu.xml").write_text(re.sub(r'<gpu id="3".*?</gpu>', "", xml, flags=re.S))
    # every GPU first waits to receive: a deadlock (steps renumbered in the new order)
    from kernels.gc3.xml_io import read_xml, write_xml

    prog = read_xml(xml)
    for gpu in prog.gpus:
        tb = gpu.threadblocks[0]
        recv = next(i for i, st in enumerate(tb.steps) if st.type.receives and not st.deps)
        tb.steps.insert(0, tb.steps.pop(recv))
        for i, st in enumerate(tb.steps):
            st.s, st.deps, st.has_dep = i, [], False
    (files / "deadlock.xml").write_text(write_xml(prog))
    # broken copies of a real results directory
    for name, meta, stats in (
            ("res_bad_meta", '{"kind": "calibration", "config": {', None),
            ("res_random_meta", bytes(rng.randrange(256) for _ in range(512)), None),
            ("res_profile_meta", json.dumps(profile), None),
            ("res_truncated_stats", None, "cut"),
            ("res_random_stats", None, bytes(rng.randrange(256) for _ in range(2048))),
            ("res_empty_stats", None, "")):
        d = files / name
        shutil.copytree(res, d)
        if meta is not None:
            (d / "meta.json").write_bytes(meta if isinstance(meta, bytes) else meta.encode())
        if stats == "cut":
            text = (d / "stats.csv").read_text()
            (d / "stats.csv").write_text(text[: text.index("\n") + 20])
        elif stats is not None:
            (d / "stats.csv").write_bytes(stats if isinstance(stats, bytes) else stats.encode())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    if not MPIEXEC.exists():
        pytest.skip("the mpich wheel's mpiexec is not installed")
    root = tmp_path_factory.mktemp("bad_input")
    res = root / "res"
    r = _python_m(*RUN.split(), "--out", str(res), ranks=2)
    assert r.returncode == 0, r.stderr
    _make_files(root / "files", res)
    return root


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Outcome:
    rc: int
    lines: list[str]
    cpu_s: float
    wall_s: float
    timed_out: bool


def _run(case: Case, root: Path, n: int) -> Outcome:
    import time

    tmp = root / f"case{n}"
    tmp.mkdir(exist_ok=True)
    subst = {"tmp": str(tmp), "files": str(root / "files"), "res": str(root / "res")}
    argv = [a.format(**subst) for a in case.argv]
    cmd = [sys.executable, "-m", *argv]
    if case.ranks:
        cmd = [str(MPIEXEC), "-n", str(case.ranks), *cmd]
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, str(CPUTIME), *cmd], cwd=ROOT, capture_output=True, text=True,
                           timeout=WALL_LIMIT_S, env=dict(launch_free_environ(), PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        return Outcome(-1, out.splitlines(), float("nan"), WALL_LIMIT_S, True)
    wall = time.perf_counter() - t0
    err = r.stderr.splitlines()
    cpu = float(err[-1].split()[1]) if err and err[-1].startswith("cputime ") else float("nan")
    lines = [ln for ln in r.stdout.splitlines() + err[:-1] if ln.strip()]
    return Outcome(r.returncode, lines, cpu, wall, False)


@pytest.fixture(scope="module")
def outcomes(inputs):
    """Every case run once, several at a time; the digests of the real results before and after."""
    before = {"stats": _digest(inputs / "res" / "stats.csv"), "meta": _digest(inputs / "res" / "meta.json")}
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {c.id: pool.submit(_run, c, inputs, i) for i, c in enumerate(CASES)}
        results = {k: f.result() for k, f in futures.items()}
    after = {"stats": _digest(inputs / "res" / "stats.csv"), "meta": _digest(inputs / "res" / "meta.json")}
    return results, before, after


def test_table_is_big_and_ids_unique():
    assert len(CASES) >= 150
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(reason=c.xfail, strict=False)]
                                               if c.xfail else []) for c in CASES])
def test_bad_input(case, outcomes):
    results, before, after = outcomes
    o = results[case.id]
    shown = "\n".join(o.lines[-8:])
    assert not o.timed_out, f"still running after {WALL_LIMIT_S:.0f} s (a hang):\n{shown}"
    assert o.rc not in (0, -1), f"accepted (exit {o.rc}):\n{shown}"
    assert not any("Traceback" in ln for ln in o.lines), f"traceback:\n{shown}"
    assert o.cpu_s <= CPU_LIMIT_S, f"took {o.cpu_s:.1f} s of CPU time (limit {CPU_LIMIT_S:.0f}):\n{shown}"
    errors = [ln for ln in o.lines if "error" in ln.lower()]
    assert len(errors) == 1, f"{len(errors)} error lines instead of one:\n{shown}"
    assert o.lines[-1] == errors[0], f"the error is not the last line:\n{shown}"
    assert re.search(case.expect, errors[0], flags=re.IGNORECASE), \
        f"does not name the problem ({case.expect}): {errors[0]}"
    for name in case.unchanged:
        assert before[name] == after[name], f"the measured {name} changed"
