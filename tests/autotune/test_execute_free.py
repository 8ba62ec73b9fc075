"""Plans executed one after another in one process free everything of the previous
plan: the weights of a finished plan are gone (weak references die), so the next
plan's peak memory is its own; a plan that runs out of memory is recorded as such
and the summary lists it apart from the measured ones."""
import json
import os
import socket
import weakref

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from autotune.execute import result  # noqa: E402
from autotune.sbp.baselines import data_parallel  # noqa: E402
from autotune.sbp.boxing import Coster  # noqa: E402
from autotune.sbp.cost import Problem  # noqa: E402
from autotune.sbp.mesh import Cluster  # noqa: E402
from autotune.sbp.plan import build_plan  # noqa: E402
from calibrate.profile import Profile  # noqa: E402
from models import load_model  # noqa: E402

TINY = dict(layers=2, hidden=8, heads=4, sequence=4, vocabulary=16, batch=8, micro_batch=4, ffn=32)


def _worker(rank, port, plan_file, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from autotune.execute.env import start, stop
    from autotune.execute.runner import free_device, run_plan
    d = start("cpu")
    plan = json.loads(open(plan_file).read())
    alive = []
    for _ in range(2):
        free_device(d)
        _, model = run_plan(plan, d, steps=2, warmup=0, profile_steps=1, dtype="bfloat16")
        refs = [weakref.ref(p) for p in model.parameters()]
        model.release()
        del model
        free_device(d)
        alive.append(sum(r() is not None for r in refs))
    torch.save(alive, out)
    stop(d)


def test_weights_of_a_finished_plan_are_freed(tmp_path):
    graph = load_model("gpt", None, TINY)
    problem = Problem(graph, Coster(Profile.load("h200-nvlink"), Cluster(1, 1)))
    plan = build_plan(problem, data_parallel(problem), "data parallel")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path / "plan.json"), str(tmp_path / "alive.pt")), nprocs=1)
    assert torch.load(tmp_path / "alive.pt") == [0, 0]


def test_out_of_memory_plan_is_listed_apart():
    ok = {"kind": result.KIND, "version": result.VERSION, "strategy": "a", "model": {}, "cluster": {"nodes": 1, "gpus_per_node": 2},
          "device": "gpu", "backend": "nccl", "dtype": "bfloat16", "predicted": {"step_s": 0.1},
          "measured": {"losses": [2.0, 1.0], "step_s": 0.11, "comm_s": None, "peak_memory_bytes": None}}
    oom = {"strategy": "b", "error": "out of memory", "predicted": {}}
    s = result.summary([ok, oom])
    assert [r["strategy"] for r in s["rows"]] == ["a"]
    assert s["failed"] == [{"strategy": "b", "error": "out of memory"}]
    assert "not measured: b: out of memory" in result.markdown(s)


def test_exposed_communication_closed_form():
    from autotune.execute.trace import exposed_time
    # comm [0,10] and [20,30]; compute [2,5], [4,8] (union [2,8]) and [25,40]: exposed 4 + 5
    assert exposed_time([(0, 10), (20, 30)], [(2, 5), (4, 8), (25, 40)]) == 9
    assert exposed_time([(0, 10), (5, 12)], []) == 12
    assert exposed_time([(3, 4)], [(0, 10)]) == 0
