"""python -m autotune export: a plan file's searched plan and baselines as torchtitan's job config and
Megatron-LM's flags; what they cannot express, with the nearest baseline's predicted figures; bad input."""
import json

import numpy as np
import pytest

from autotune.__main__ import main
from autotune.export import export, layout
from autotune.sbp.baselines import data_parallel, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.sbp.plan import PlanFile, build_plan
from calibrate.errors import OptionError, UserError
from calibrate.profile import Profile
from models import load_model

TINY = dict(layers=2, hidden=64, heads=4, sequence=16, vocabulary=128, batch=16, micro_batch=8, ffn=256)


@pytest.fixture(scope="module")
def plans():
    """On 2 nodes x 4 GPUs (fine axes 2, 2, 2): Megatron (d=(2, 1), t=(1, 4)), data parallel, and a plan
    that is the Megatron one but for one layer's placement."""
    problem = Problem(load_model("gpt", None, TINY), Coster(Profile.load("h200-nvlink+ib400"), Cluster(2, 4)))
    mega = megatron_assignment(problem, (2, 1), (1, 4))
    assert mega is not None
    rng = np.random.default_rng(0)
    fc1 = next(v for v, op in enumerate(problem.ops) if op.layer.name == "fc1")
    other = list(mega)
    other[fc1] = next(i for i in rng.permutation(len(problem.choices[fc1])) if i != mega[fc1])
    return {"megatron": build_plan(problem, mega, "Megatron (d=(2, 1), t=(1, 4))"),
            "dp": build_plan(problem, data_parallel(problem), "data parallel"),
            "searched": build_plan(problem, other, "searched (test)")}


def plan_file(best, *baselines) -> PlanFile:
    return PlanFile(json.loads(json.dumps(best)), [json.loads(json.dumps(b)) for b in baselines])


def test_megatron_baseline_exactly(plans):
    e = export(plan_file(plans["megatron"], plans["dp"]), "megatron")
    assert (e.layout.data, e.layout.tensor, e.layout.fsdp, e.layout.pipeline) == (2, 4, 1, 1)
    assert e.cannot == () and "expresses this plan exactly" in e.text
    flags = e.config.split()
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "4"
    assert flags[flags.index("--micro-batch-size") + 1] == "4"  # 8 sequences over 2 data-parallel ranks
    assert flags[flags.index("--global-batch-size") + 1] == "16"
    assert "--sequence-parallel" not in flags and "--recompute-granularity" not in flags


def test_torchtitan_of_megatron_names_sequence_parallel(plans):
    e = export(plan_file(plans["megatron"], plans["dp"]), "torchtitan")
    assert "tensor_parallel_degree = 4" in e.config and "data_parallel_replicate_degree = 2" in e.config
    assert "data_parallel_shard_degree = 1" in e.config and "local_batch_size = 4" in e.config
    assert len(e.cannot) == 1 and "sequence parallel" in e.cannot[0]


def test_data_parallel_baseline(plans):
    pf = plan_file(plans["megatron"], plans["dp"])
    for target in ("megatron", "torchtitan"):
        e = export(pf, target, "baseline:data")
        assert (e.layout.data, e.layout.tensor) == (8, 1) and e.cannot == ()
        assert e.nearest["strategy"] == "data parallel"
    assert "data_parallel_replicate_degree = 8" in export(pf, "torchtitan", "baseline:data").config


def test_searched_plan_states_what_cannot_be_expressed(plans):
    searched, mega = plans["searched"], plans["megatron"]
    e = export(plan_file(searched, mega, plans["dp"]), "megatron")
    assert e.layout.tensor == 4 and e.layout.data == 2
    assert e.nearest["strategy"] == mega["strategy"]
    assert e.nearest["step_s"] == mega["totals"]["step_s"]
    assert any(c.startswith("layer fc1 ") for c in e.cannot)
    assert not any(c.startswith("layer qkv ") for c in e.cannot)  # the layers that agree are not listed
    assert "cannot express this plan exactly" in e.text and f"{mega['totals']['step_s']:.4g} s/step" in e.text


def test_fsdp_and_recompute(plans):
    dp = json.loads(json.dumps(plans["dp"]))
    dp.update(strategy="searched (fsdp)", recompute="full", sharding={"mode": "fsdp", "axes": [1, 2]})
    e = export(plan_file(dp, plans["dp"]), "torchtitan")
    assert "data_parallel_shard_degree = 4" in e.config and "data_parallel_replicate_degree = 2" in e.config
    assert 'mode = "full"' in e.config
    m = export(plan_file(dp, plans["dp"]), "megatron")
    assert "--recompute-granularity full" in m.config and "--recompute-method uniform" in m.config
    assert "--use-megatron-fsdp" in m.config
    assert any("hybrid sharding" in c for c in m.cannot)
    dp["sharding"]["axes"] = [0]  # the outermost axis: not where the frameworks shard
    assert any("not the innermost data axes" in c for c in export(plan_file(dp, plans["dp"]), "torchtitan").cannot)


def test_pipeline_stages(plans):
    stage = json.loads(json.dumps(plans["dp"]))
    stage["cluster"] = {"nodes": 1, "gpus_per_node": 4}
    stage["layers"] = [dict(lay, sbp={k: v.replace("(2, 4)", "(1, 4)") if isinstance(v, str) else
                                      {n: t.replace("(2, 4)", "(1, 4)") for n, t in v.items()}
                                      for k, v in lay["sbp"].items()}) for lay in stage["layers"]]
    piped = dict(json.loads(json.dumps(plans["dp"])), strategy="searched (pipeline)",
                 stages=[{"layers": [0, 5], "plan": stage}, {"layers": [5, 11], "plan": stage}])
    lo = layout(piped)
    assert (lo.pipeline, lo.data, lo.tensor) == (2, 4, 1)
    e = export(plan_file(piped), "torchtitan")
    assert "pipeline_parallel_degree = 2" in e.config and "pipeline_parallel_microbatch_size = 2" in e.config
    assert "--pipeline-model-parallel-size 2" in export(plan_file(piped), "megatron").config


def test_bad_input(plans, tmp_path, capsys):
    pf = plan_file(plans["megatron"])
    with pytest.raises(OptionError):
        export(pf, "deepspeed")
    with pytest.raises(OptionError):
        export(pf, "megatron", "baseline:summa")
    with pytest.raises(UserError, match="recompute"):
        export(plan_file(dict(plans["megatron"], recompute="sometimes")), "megatron")
    with pytest.raises(UserError, match="no layers"):
        export(plan_file(dict(plans["megatron"], layers=[])), "megatron")
    assert main(["export", str(tmp_path / "missing.json"), "--to", "megatron"]) == 2
    assert "does not exist" in capsys.readouterr().err
    path = tmp_path / "plan.json"
    pf.save(path)
    out = tmp_path / "flags.txt"
    assert main(["export", str(path), "--to", "megatron", "--out", str(out)]) == 0
    assert out.read_text() == capsys.readouterr().out


def test_next_steps_name_the_call_that_applies_the_plan():
    from autotune.export import next_steps
    one = "\n".join(next_steps("p.json", {"cluster": {"nodes": 1, "gpus_per_node": 4}}))
    staged = "\n".join(next_steps("p.json", {"cluster": {"nodes": 2, "gpus_per_node": 8}, "stages": [{}, {}]}))
    assert 'model = autotune.apply("p.json", model)' in one and "apply_pipeline" not in one
    assert 'pipe = autotune.apply_pipeline("p.json", model)' in staged and "torchrun --nnodes 2" in staged
