"""The memory model's activations (autotune.sbp.memory.kept_bytes) against what the
executed forward pass really keeps for the backward pass, counted without an
allocator (autotune.execute.saved: the storages autograd saves, on 2 gloo processes,
bfloat16): equal, byte for byte, for every layer of data parallelism, Megatron, SUMMA
and random plans that use the split layer norm and the replicated loss."""
import json
import os
import socket

import numpy as np
import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from autotune.sbp.baselines import best_mesh, data_parallel, megatron_assignment, summa_assignment  # noqa: E402
from autotune.sbp.boxing import Coster  # noqa: E402
from autotune.sbp.cost import Problem  # noqa: E402
from autotune.sbp.memory import kept_bytes  # noqa: E402
from autotune.sbp.mesh import Cluster  # noqa: E402
from autotune.sbp.plan import build_plan  # noqa: E402
from calibrate.profile import Profile  # noqa: E402
from models import load_model  # noqa: E402

MODEL = dict(layers=1, hidden=32, heads=4, sequence=16, vocabulary=64, batch=8, micro_batch=4)


def plans():
    """(plan, predicted kept bytes per distinct layer) of several plans on 1 x 2 devices."""
    graph = load_model("gpt", None, MODEL)
    problem = Problem(graph, Coster(Profile.load("h200-nvlink"), Cluster(1, 2)))
    chosen = [(problem, data_parallel(problem), "data parallel")]
    mega, _, _ = best_mesh(problem, megatron_assignment)
    chosen.append((problem, mega, "Megatron"))
    summa_problem = Problem(graph, problem.coster, signatures=("summa",))
    summa, _, _ = best_mesh(summa_problem, summa_assignment)
    chosen.append((summa_problem, summa, "SUMMA"))
    rng = np.random.default_rng(3)
    chosen += [(problem, problem.random_assignment(rng), f"random {i}") for i in range(4)]
    out = []
    for p, a, name in chosen:
        kept = [kept_bytes(p.choices[v][i], p.cluster, p.act_bytes) for v, i in enumerate(a)]
        out.append((build_plan(p, a, name), kept))
    return graph, out


def _worker(rank, port, plans_file, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    from autotune.execute.data import batch
    from autotune.execute.env import start, stop
    from autotune.execute.runner import build
    from autotune.execute.saved import saved_bytes
    d = start("cpu")
    res = []
    for plan in json.loads(open(plans_file).read()):
        graph, _, model = build(plan, d, None, "bfloat16", 0)
        res.append(saved_bytes(model, batch(graph, 0, 0, 0, d.device, model.ctx.dtype), 1.0))
    torch.save(res, f"{out}.{rank}")
    stop(d)


def test_kept_activations_match_the_executed_step(tmp_path):
    graph, items = plans()
    signatures = {lay["signature"] for plan, _ in items for lay in plan["layers"]}
    assert {"summa", "layernorm-split", "loss", "loss-replicated", "attention"} <= signatures
    (tmp_path / "plans.json").write_text(json.dumps([p for p, _ in items]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path / "plans.json"), str(tmp_path / "saved")), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"saved.{rank}")
        for (plan, kept), measured in zip(items, got):
            predicted = [int(kept[v]) for v in graph.chain]
            assert measured == predicted, f"{plan['strategy']} (rank {rank}): kept {measured}, model {predicted}"
