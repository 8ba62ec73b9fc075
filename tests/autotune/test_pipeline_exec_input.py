"""The pipelined plan as apply_pipeline reads it: per stage its typed plan on the submesh and its blocks;
bad input (not a pipelined plan, a split that is not the model's or not its stages' plans, an unknown
schedule, a token split that cuts sequences, a boundary route that is not
one or whose sent placement is not its stream's with the partial sums split, a module it cannot cut, a world
other than the plan's) is one UserError line naming the fix, before any weight moves."""
import copy
import os

import pytest

if not os.environ.get("CI"):
    pytest.importorskip("torch")
import torch  # noqa: E402

from calibrate.errors import UserError  # noqa: E402
from pipeline_exec_plans import GPT, make_model, searched  # noqa: E402

from autotune.apply.pipeline import apply_pipeline  # noqa: E402
from autotune.apply.pipeplan import load_pipelined  # noqa: E402


@pytest.fixture(scope="module")
def plan():
    return searched(dict(GPT, batch=32), 2)


def test_stages_typed_on_their_submesh(plan, tmp_path):
    from autotune.plan.file import PlanFile
    pp = load_pipelined(plan)
    split = pp.pipeline.split
    assert pp is plan and pp.pipeline.schedule == "1f1b" and pp.world == 4 and pp.submesh.devices == 2
    assert [s.plan.model.get("layers") for s in pp.stages] == list(split)
    assert pp.stages[0].plan.layers[0].name == "embedding" and pp.stages[-1].plan.layer("logits") is not None
    assert pp.stages[0].plan.mesh.sizes == (2,) and pp.chunk_ranges()[1] == (split[0], 4)
    PlanFile(plan, []).save(tmp_path / "plan.json")  # plan.json whose best is pipelined
    assert load_pipelined(tmp_path / "plan.json") == pp


def _edit(plan, f):
    out = copy.deepcopy(plan.to_dict())
    f(out)
    return out


@pytest.mark.parametrize("edit,msg", [
    (lambda p: p.update({k: p["stages"][0]["plan"][k] for k in ("layers", "cluster", "mesh")}, stages=[],
                        pipeline=None), "has no pipeline stages"),
    (lambda p: p["pipeline"].update(split=[2, 3]), "gives 5 blocks but the model has 4"),
    (lambda p: p["pipeline"].update(split=[1, 3]), "repeats its block layers [2] times but the split"),
    (lambda p: p["pipeline"].update(schedule="zb"), "schedule 'zb' is not one of"),
    (lambda p: p.update(cluster={"nodes": 1, "gpus_per_node": 2}, mesh={"sizes": [2], "names": ["g0"]}),
     "do not make the cluster"),
    (lambda p: p["model"].update(micro_batch=1), "splits the tokens of a micro-batch of 1 sequences over 2"),
    (lambda p: p["stages"].reverse(), "the first stage holds the embedding"),
    (lambda p: p["stages"][0].update(boundary_route="zz"), "boundary route 'zz' is not one of direct, scatter"),
    (lambda p: p["stages"][0].update(boundary_route="scatter", boundary_sent=["S0", "S1"]),
     "with each partial-sum axis split, as the scatter route sends it"),
])
def test_bad_pipelined_plan_is_one_line(plan, edit, msg):
    with pytest.raises(UserError) as e:
        load_pipelined(_edit(plan, edit))
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_bad_module_or_world_is_one_line(plan):
    with pytest.raises(UserError, match="cuts the reference modules"):
        apply_pipeline(plan, torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match="but 1 processes run: launch 4"):
        apply_pipeline(plan, make_model(GPT))
