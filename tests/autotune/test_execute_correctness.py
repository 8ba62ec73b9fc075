"""Plans executed on 4 processes (gloo, float64) against the same model in one
process: the loss of every step and every weight after two Adam steps agree to
1e-9 (relative), and so do the gradients of the last step (Adam would hide a
wrong scale of them), for the searched plan, data parallelism, Megatron and two random
plans that use partial sums (and SUMMA, whose layers gather panels inside), on a 2 x 2 cluster and a 1 x 4 cluster; a plan with
one wrong placement (a row-parallel output declared B instead of P) disagrees."""
import json
import os

import numpy as np
import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from autotune.sbp.baselines import best_mesh, data_parallel, megatron_assignment, summa_assignment  # noqa: E402
from autotune.sbp.boxing import Coster  # noqa: E402
from autotune.sbp.cost import Problem  # noqa: E402
from autotune.sbp.mesh import Cluster  # noqa: E402
from autotune.sbp.plan import build_plan  # noqa: E402
from autotune.sbp.search import Budget, make_search  # noqa: E402
from calibrate.profile import Profile  # noqa: E402
from models import load_model  # noqa: E402
from tiny_models import free_port  # noqa: E402

TINY = dict(layers=2, hidden=8, heads=4, sequence=4, vocabulary=16, batch=8, micro_batch=4, ffn=32)
MLP = dict(dims=[8, 16, 8], batch=8, micro_batch=4)
STEPS, LR, SEED = 2, 1e-2, 0
RTOL = 1e-9


def make_plans(nodes, gpus) -> tuple[list[dict], dict]:
    graph = load_model("gpt", None, TINY)
    problem = Problem(graph, Coster(Profile.load("h200-nvlink+ib400"), Cluster(nodes, gpus)))
    plans = [build_plan(problem, make_search("cd").run(problem, Budget(steps=300), np.random.default_rng(0)).assignment,
                        "searched (cd)"),
             build_plan(problem, data_parallel(problem), "data parallel")]
    mega, _, mesh = best_mesh(problem, megatron_assignment)
    plans.append(build_plan(problem, mega, f"Megatron {mesh}"))
    rng = np.random.default_rng(1)
    seen = set()
    while len(plans) < 5:
        a = problem.random_assignment(rng)
        if tuple(a) not in seen and any(problem.choices[v][i].uses_partial for v, i in enumerate(a)):
            seen.add(tuple(a))
            plans.append(build_plan(problem, a, f"random {len(plans) - 2}"))
    summa_problem = Problem(graph, problem.coster, signatures=("summa",))
    summa, _, mesh = best_mesh(summa_problem, summa_assignment)
    plans.append(build_plan(summa_problem, summa, f"SUMMA {mesh}"))
    broken = json.loads(json.dumps(plans[2]))
    proj = next(lay for lay in broken["layers"] if lay["name"] == "proj")
    assert "P:" in proj["sbp"]["output"]
    proj["sbp"]["output"] = proj["sbp"]["output"].replace("P:", "B:")
    broken["strategy"] = "broken Megatron (proj output B instead of P)"
    return plans, broken



def _worker(rank, world, port, plans_file, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from autotune.execute.env import start, stop
    from autotune.execute.runner import gather_weights, run_plan
    d = start("cpu")
    results = []
    for plan in json.loads(open(plans_file).read()):
        rec, model = run_plan(plan, d, steps=STEPS, warmup=0, profile_steps=0, dtype="float64", seed=SEED, lr=LR)
        results.append({"losses": rec["measured"]["losses"], "weights": gather_weights(model),
                        "grads": gather_weights(model, grads=True)})
    if rank == 0:
        torch.save(results, out)
    stop(d)


def run_distributed(plans, tmp_path, world=4):
    pf, out = tmp_path / "plans.json", tmp_path / "results.pt"
    pf.write_text(json.dumps(plans))
    mp.spawn(_worker, args=(world, free_port(), str(pf), str(out)), nprocs=world)
    return torch.load(out)


def mismatch(ref, got) -> str | None:
    """What differs between the one-process run and a plan's run (None: nothing, to RTOL)."""
    ref_losses, ref_weights, ref_grads = ref
    if not np.allclose(got["losses"], ref_losses, rtol=RTOL, atol=0):
        return f"losses {got['losses']} != {ref_losses}"
    for what, want, have in (("weight", ref_weights, got["weights"]), ("gradient", ref_grads, got["grads"])):
        for pos, (a, b) in enumerate(zip(want, have)):
            for name in a:
                if not torch.allclose(b[name], a[name], rtol=RTOL, atol=RTOL):
                    return f"{what} {name} at chain position {pos} differs by {(b[name] - a[name]).abs().max():.3g}"
    return None


def mlp_plan(nodes, gpus) -> dict:
    graph = load_model("mlp", None, MLP)
    problem = Problem(graph, Coster(Profile.load("h200-nvlink+ib400"), Cluster(nodes, gpus)))
    a = make_search("cd").run(problem, Budget(steps=100), np.random.default_rng(0)).assignment
    return build_plan(problem, a, "searched MLP")


def references(plans) -> list:
    from autotune.execute.planread import plan_graph
    from autotune.execute.reference import train_reference
    cache = {}
    for p in plans:
        key = json.dumps(p["model"], sort_keys=True)
        if key not in cache:
            cache[key] = train_reference(plan_graph(p), SEED, STEPS, LR)
    return [cache[json.dumps(p["model"], sort_keys=True)] for p in plans]


@pytest.mark.parametrize("nodes,gpus", [(2, 2), (1, 4)])
def test_plans_match_one_process(nodes, gpus, tmp_path):
    plans, broken = make_plans(nodes, gpus)
    if gpus == 4:
        plans.append(mlp_plan(nodes, gpus))
    refs = references(plans + [broken])
    results = run_distributed(plans + [broken], tmp_path)
    assert len(results) == len(plans) + 1
    for plan, ref, got in zip(plans, refs, results):
        assert mismatch(ref, got) is None, f"{plan['strategy']} on {nodes}x{gpus}: {mismatch(ref, got)}"
    assert mismatch(refs[-1], results[-1]) is not None, "a wrong placement went unnoticed"
    assert refs[0][0][1] != pytest.approx(refs[0][0][0])  # the loss moved between the steps
