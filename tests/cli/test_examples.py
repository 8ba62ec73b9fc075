"""Every command example in the README and in every ``--help`` runs as shown.

The examples are collected from the text itself (lines with ``python -m``), so a
new example is caught here: each must be in ``HOW`` (how this test runs it, with
smaller sizes where the example is expensive) or in ``ELSEWHERE`` (why it runs in
another test or only on GPUs)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).with_name("mpiexec")
HELPS = ["calibrate", "calibrate run", "calibrate fit", "calibrate validate", "calibrate profiles",
         "calibrate compute", "calibrate health", "autotune", "autotune validate", "autotune reshard", "autotune schedule",
         "autotune execute", "autotune nccl", "autotune reproduce", "autotune explain", "kernels", "kernels compile", "kernels check", "kernels bench",
         "reports"]
GPU = "needs GPUs (tests/gpu/run_all.sh)"
# example (as written, whitespace collapsed) -> (extra arguments that keep it small, results it needs first)
HOW = {
    "python -m autotune --model gpt": (["--budget", "0.3", "--compare", "none"], []),
    "python -m autotune --model gpt --preset gpt3-175b --nodes 512 --gpus-per-node 8":
        (["--budget", "0.3", "--compare", "none"], []),
    "python -m autotune --model mlp --nodes 128 --gpus-per-node 1 --profile piz-daint --search exhaustive":
        (["--budget", "0.3", "--compare", "none"], []),
    "mpiexec -n 4 python -m calibrate run --backend mpi -b 1K -e 16M --check --out results/laptop":
        (["-e", "4K", "-c", "allreduce", "--groups", "world", "--iters", "2", "--reps", "2", "--warmup", "1"], []),
    "python -m calibrate fit results/node -o node.json": ([], ["results/node"]),
    "python -m calibrate validate --profile node.json results/other-run": ([], ["results/other-run", "node.json"]),
    "python -m calibrate profiles": ([], []),
    "python -m calibrate compute declare --out heldout.json": ([], []),
    "python -m reports results/node node.json -o report.html": ([], ["results/node", "node.json"]),
    "mpiexec -n 4 python -m autotune validate --backend mpi --profile gcp-a100":
        (["--plans", "3", "--iters", "2", "--warmup", "1"], []),
    "python -m autotune reshard --src-mesh 2,4 --src-spec S0RR --dst-mesh 2,4 --dst-spec S0RR "
    "--shape 1024,1024,512": ([], []),
    "python -m autotune reshard --case 4": ([], []),
    "python -m autotune reshard --all-cases --pipeline u-transformer-like --results reshard.json": ([], []),
    "python -m autotune schedule --collective allreduce --gpus 2 --out tuned/": (["--sizes", "1K:1M:32"], []),
    "python -m autotune schedule --rescore tuned/schedule.json": ([], ["tuned/schedule.json"]),
    "python -m kernels compile <algorithm> --ranks 8 ... -o x.xml": ([], []),
    "python -m kernels check x.xml": ([], ["x.xml"]),
    "python -m autotune explain papers-plan": ([], []),
    "python -m autotune --model llama --preset llama3-8b --nodes 1 --gpus-per-node 8 --micro-batch 8 --out plan8":
        (["--budget", "0.3", "--compare", "none"], []),
    "python -m autotune export plan8/plan.json --to torchtitan": ([], ["plan8/plan.json"]),
    "python -m autotune --model gpt --preset gpt3-175b --nodes 512 --gpus-per-node 8 --pipeline 16 "
    "--schedule eager-1f1b": (["--budget", "0.3", "--compare", "none"], []),
}
ELSEWHERE = {
    "srun --mpi=pmi2 python -m calibrate health --profile results/x/profile.json --out health.json":
        "needs several nodes: tests/integration/test_multinode.py runs it on a cluster of network namespaces",
    "mpirun -np 8 python -m calibrate run --backend nccl --mode graph -b 1K -e 1G --check --out results/node": GPU,
    "mpirun -np 8 python -m calibrate run --backend nccl --mode graph -b 1408 -e 1G --check --refine --random 32 "
    "--out results/steps": GPU,
    "python -m calibrate fit results/steps --validation results/steps-random -o steps.json": "the results of a GPU "
    "run: tests/calibrate/test_run_mpi.py fits with --validation on an MPI run",
    "mpirun -np 8 python -m calibrate validate --profile node.json --random 32 --seed 1 --out results/random": GPU,
    "python -m autotune reproduce autoddl": "every AutoDDL case: minutes of search; "
                                            "tests/autotune/test_sbp_reproduce.py runs one case end to end",
    "python -m calibrate compute --out h200.json": GPU,
    "torchrun --nproc-per-node 4 -m autotune tune --model config.json":
        "several processes: tests/autotune/test_tune.py runs the tune loop on gloo",
    "python -m calibrate compute --profile h200-nvlink --out my.json --dtypes bf16": GPU,
    "python -m calibrate compute evaluate --heldout heldout.json --profile my.json --out eval.json":
        "a GPU's compute model: tests/calibrate/test_compute_evaluate.py runs it on the CPU stand-in",
    "mpirun -np 2 python -m autotune validate --backend nccl --gpus-per-node 2": GPU,
    "mpirun -np 2 python -m autotune schedule --collective allreduce --gpus 2 --out tuned/": GPU,
    "mpiexec -n 8 python -m autotune reshard --execute mpi --scenario S0RR@2,2:RRR@2,2 --shape 64,64,32 "
    "--devices-per-host 2 --solvers naive,ensemble": "8 MPI ranks: tests/kernels/test_reshard_mpi.py runs --execute",
    "python -m kernels bench": GPU,
    "python -m kernels peers": GPU,
    "python -m kernels tp-mlp": GPU,
    "python -m kernels reshard plan.json": "under mpiexec: tests/kernels/test_reshard_mpi.py",
    "python -m kernels build-tuner": "a C compiler and NCCL's headers: tests of the tuner plugin",
    "python -m kernels build-tuner # kernels/nccl_tuner/build/libnccl-tuner-commtune.so":
        "a C compiler and NCCL's headers: tests of the tuner plugin",
    "mpirun -np 8 python -m autotune nccl --out tuned": GPU,
    "mpirun -np 2 python -m autotune nccl --out tuned/": GPU,
    "mpirun -np 2 python -m autotune nccl --table tuned/nccl_tuner.csv --out again/": GPU,
    "mpirun -np 2 python -m autotune nccl evaluate tuned/": GPU,
    "mpirun -np 2 python -m autotune schedule evaluate tuned/": GPU,
    "torchrun --nproc-per-node 2 -m autotune execute out/plan.json --which all --out exec":
        "torch distributed: tests/autotune/test_execute*.py",
    "mpiexec -n 4 python -m autotune execute plan.json --layers 2 --steps 6": "torch: tests/autotune/test_execute*.py",
    "srun -n 8 python -m autotune execute plan.json": "Slurm: tests/integration/test_slurm.py",
    "python -m autotune execute --summarize exec": "a finished run: tests/autotune/test_execute*.py",
    "python -m autotune execute --fit-host d2 d8 t2 t8 --profile p.json --profile-out p-host.json":
        "finished runs: tests/autotune/test_hostfit.py",
    "python -m autotune execute plan.json": "torch: tests/autotune/test_execute*.py",
    "python -m calibrate run": "the README's prose, not a command line",
    "python -m autotune explain megatron-meshes CASE": "a placeholder (CASE): tests/autotune/test_sbp_reproduce.py",
    "python -m autotune explain summa CASE --micro-batch N":
        "placeholders (CASE, N): tests/autotune/test_sbp_reproduce.py",
    "python -m autotune explain versus-data-parallel CASE":
        "a placeholder (CASE): tests/autotune/test_sbp_reproduce.py",
    "python -m autotune export plan.json --to torchtitan|megatron":
        "a choice of targets (torchtitan|megatron): the README's export runs here, tests/autotune/test_export.py "
        "exports both",
    "torchrun --nproc-per-node 4 -m autotune execute plan.json --module mypkg.model:build":
        "a user's module (mypkg.model:build): tests/autotune/test_execute_input.py loads --module factories",
}


def _strip(line: str) -> str:
    """The command: comment and optional ``[...]`` parts dropped, whitespace collapsed."""
    line = re.sub(r"\s+#.*$", "", line.strip()) if "# " in line else line.strip()
    line = re.sub(r"\s\[[^]]*\]", "", line)
    return " ".join(line.split())


def examples() -> dict[str, str]:
    """example -> where it was found."""
    found = {}
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", readme, flags=re.S)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            if "python -m" in line and "pip install" not in line:
                found.setdefault(_strip(line), "README")
    for line in readme.splitlines():
        if line.lstrip().startswith(("mpiexec", "mpirun", "python -m")):
            found.setdefault(_strip(line), "README")
    for cmd in HELPS:
        r = subprocess.run([sys.executable, "-m", *cmd.split(), "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        text = r.stdout.replace("\\\n", " ")
        for line in text.splitlines():
            s = line.strip()
            # "python -m X: what it does" heads a --help: a title, not an example
            title = re.match(r"^[^#]*?:(\s|$)", s)
            if (re.match(r"^(mpiexec|mpirun|srun|torchrun|python -m)\b", s) and " ... " not in f" {s} "
                    and " -m " in s and not title):
                found.setdefault(_strip(s), f"{cmd} --help")
            elif s.startswith("python -m kernels compile <algorithm>"):
                found.setdefault(_strip(s), f"{cmd} --help")
    return found


@pytest.fixture(scope="module")
def found():
    return examples()


def test_every_example_is_known(found):
    unknown = [f"{e}   ({where})" for e, where in found.items() if e not in HOW and e not in ELSEWHERE]
    assert not unknown, "examples this test does not know how to run:\n" + "\n".join(unknown)


def _argv(example: str, extra: list[str]) -> list[str]:
    words = example.split()
    words = [{"<algorithm>": "ring_allreduce", "...": ""}.get(w, w) for w in words]
    words = [w for w in words if w]
    head = []
    if words[0] in ("mpiexec", "mpirun"):
        head = [str(MPIEXEC), "-n", words[2]]
        words = words[3:]
    assert words[:2] == ["python", "-m"], example
    return head + [sys.executable, "-m", *words[2:], *extra]


def _run(argv, cwd, timeout=600):
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr
    return r


def _prepare(needs: list[str], cwd: Path) -> None:
    small = ["-b", "1K", "-e", "8K", "-c", "allreduce,sendrecv", "--groups", "world", "--iters", "2", "--reps", "2",
             "--warmup", "1"]
    for need in needs:
        if (cwd / need).exists():
            continue
        if need.startswith("results/"):
            _run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "calibrate", "run", "--backend", "mpi", *small,
                  "--out", need], cwd)
        elif need == "node.json":
            _prepare(["results/node"], cwd)
            _run([sys.executable, "-m", "calibrate", "fit", "results/node", "-o", "node.json"], cwd)
        elif need == "tuned/schedule.json":
            _run([sys.executable, "-m", "autotune", "schedule", "--collective", "allreduce", "--gpus", "2",
                  "--sizes", "1K:1M:32", "--out", "tuned/"], cwd)
        elif need == "plan8/plan.json":
            _run([sys.executable, "-m", "autotune", "--model", "llama", "--preset", "llama3-8b", "--nodes", "1",
                  "--gpus-per-node", "8", "--micro-batch", "8", "--budget", "0.3", "--compare", "none", "--out", "plan8"], cwd)
        elif need == "x.xml":
            _run([sys.executable, "-m", "kernels", "compile", "ring_allreduce", "--ranks", "8", "-o", "x.xml"], cwd)


@pytest.mark.parametrize("example", sorted(HOW))
def test_example_runs(example, tmp_path_factory, found):
    if example not in found:
        pytest.skip("no longer in the README or a --help")
    if example.startswith(("mpiexec", "mpirun")) and not MPIEXEC.exists():
        pytest.skip("the mpich wheel's mpiexec is not installed")
    extra, needs = HOW[example]
    cwd = tmp_path_factory.getbasetemp() / "examples"
    cwd.mkdir(exist_ok=True)
    _prepare(needs, cwd)
    _run(_argv(example, extra), cwd)
