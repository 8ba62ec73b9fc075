"""python -m autotune export: a plan file's searched plan and baselines as torchtitan's command-line overrides
(read back by torchtitan's own config classes and parser) and Megatron-LM's flags (their names checked against
Megatron-LM's published arguments: megatron-core's wheel does not hold its parser); what they cannot express,
decided against the exported configuration's own plan; plans they cannot run refused; bad input."""
import dataclasses
import json

import numpy as np
import pytest

from autotune.__main__ import main
from autotune.export import export, layout
from autotune.sbp.baselines import data_parallel, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.plan.build import build
from autotune.plan.file import PlanFile
from autotune.plan.typed import Plan
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
    return {"megatron": build(problem, mega, "Megatron (d=(2, 1), t=(1, 4))").to_dict(),
            "dp": build(problem, data_parallel(problem), "data parallel").to_dict(),
            "searched": build(problem, other, "searched (test)").to_dict()}


def plan_file(best, *baselines) -> PlanFile:
    return PlanFile(Plan.from_dict(json.loads(json.dumps(best))),
                    [Plan.from_dict(json.loads(json.dumps(b))) for b in baselines])


def args_of(config: str) -> list[str]:
    """The command-line words of an exported configuration (its comment lines and line continuations dropped)."""
    return [w for line in config.splitlines() if not line.startswith("#") for w in line.split() if w != "\\"]


def titan(config: str) -> dict:
    """torchtitan's overrides as {"section.field": value}, the activation-checkpoint subcommand as "ac"."""
    words, out = args_of(config), {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            out[w[2:]] = " ".join(words[i + 1:next((j for j in range(i + 1, len(words))
                                                     if words[j].startswith("--") or ":" in words[j]), len(words))])
        elif w.startswith("activation-checkpoint:"):
            out["ac"] = w.split(":", 1)[1]
    return out


def torchtitan_reads(config: str):
    """The configuration as torchtitan 0.3 reads it: its own config classes (training, parallelism, activation
    checkpointing, as its Trainer.Config holds them) parsed by tyro with its ConfigManager's rules."""
    pytest.importorskip("torchtitan")
    import tyro
    from torchtitan.config.configs import ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import ConfigManager, custom_registry
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, SelectiveAC
    ConfigManager.register_tyro_rules(custom_registry)

    @dataclasses.dataclass
    class Job:
        training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
        parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
        activation_checkpoint: ActivationCheckpointingConfig = dataclasses.field(default_factory=SelectiveAC.Config)
    return tyro.cli(Job, args=args_of(config), default=Job(), registry=custom_registry)


# Megatron-LM's arguments (megatron/training/arguments.py, core_r0.16; Megatron-FSDP's guide) that exports use
MEGATRON_ARGUMENTS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size", "--global-batch-size",
    "--seq-length", "--sequence-parallel", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy", "--use-distributed-optimizer", "--no-gradient-accumulation-fusion",
    "--ckpt-format", "--num-distributed-optimizer-instances", "--outer-dp-sharding-strategy",
    "--num-virtual-stages-per-pipeline-rank"}


def megatron_known(config: str) -> bool:
    return {w for w in args_of(config) if w.startswith("--")} <= MEGATRON_ARGUMENTS


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
    t = titan(e.config)
    assert (t["parallelism.tensor_parallel_degree"], t["parallelism.data_parallel_replicate_degree"]) == ("4", "2")
    assert t["parallelism.data_parallel_shard_degree"] == "1" and t["training.local_batch_size"] == "4"
    assert len(e.cannot) == 1 and "sequence parallel" in e.cannot[0]
    job = torchtitan_reads(e.config)
    assert (job.parallelism.tensor_parallel_degree, job.parallelism.data_parallel_replicate_degree,
            job.training.local_batch_size, job.activation_checkpoint) == (4, 2, 4, None)


def test_data_parallel_baseline(plans):
    pf = plan_file(plans["megatron"], plans["dp"])
    for target in ("megatron", "torchtitan"):
        e = export(pf, target, "baseline:data")
        assert (e.layout.data, e.layout.tensor) == (8, 1) and e.cannot == ()
        assert e.nearest is None and "expresses this plan exactly" in e.text  # it is its own configuration's plan
    assert titan(export(pf, "torchtitan", "baseline:data").config)["parallelism.data_parallel_replicate_degree"] == "8"


def test_searched_plan_states_what_cannot_be_expressed(plans):
    searched, mega = plans["searched"], plans["megatron"]
    e = export(plan_file(searched, mega, plans["dp"]), "megatron")
    assert e.layout.tensor == 4 and e.layout.data == 2
    assert e.nearest["strategy"] == mega["strategy"]
    assert e.nearest["step_s"] == mega["costs"]["step_s"]
    assert any(c.startswith("layer fc1 ") for c in e.cannot)
    assert not any(c.startswith("layer qkv ") for c in e.cannot)  # the layers that agree are not listed
    assert "cannot express this plan exactly" in e.text and f"{mega['costs']['step_s']:.4g} s/step" in e.text


def test_fsdp_and_recompute(plans):
    dp = json.loads(json.dumps(plans["dp"]))
    dp.update(strategy="searched (fsdp)", recompute="full", sharding={"mode": "fsdp", "axes": [1, 2]})
    e = export(plan_file(dp, plans["dp"]), "torchtitan")
    t = titan(e.config)
    assert (t["parallelism.data_parallel_shard_degree"], t["parallelism.data_parallel_replicate_degree"]) == ("4", "2")
    assert t["ac"] == "full" and e.cannot == ()
    m = export(plan_file(dp, plans["dp"]), "megatron")
    assert "--recompute-granularity full" in m.config and "--recompute-method uniform" in m.config
    flags = args_of(m.config)  # Megatron-FSDP as megatron-core 0.16 runs it, HSDP over the 2 outer replicas
    for flag in ("--use-megatron-fsdp", "--no-gradient-accumulation-fusion", "--use-distributed-optimizer"):
        assert flag in flags
    assert flags[flags.index("--ckpt-format") + 1] == "fsdp_dtensor"
    assert flags[flags.index("--num-distributed-optimizer-instances") + 1] == "2" and m.cannot == ()
    assert megatron_known(m.config)
    dp["sharding"]["axes"] = [0]  # the outermost axis: not where the frameworks shard
    assert any("not the innermost data axes" in c for c in export(plan_file(dp, plans["dp"]), "torchtitan").cannot)
    job = torchtitan_reads(e.config)
    assert (job.parallelism.data_parallel_shard_degree, type(job.activation_checkpoint).__qualname__) == (4, "FullAC.Config")


def _piped(plans, split=(1, 1), schedule="gpipe"):
    """2 stages of 1 node x 4 GPUs, each data parallel over its 4 GPUs (the data-parallel plan on a stage)."""
    stage = json.loads(json.dumps(plans["dp"]))
    stage["cluster"] = {"nodes": 1, "gpus_per_node": 4}
    stage["mesh"] = {k: v[1:] for k, v in stage["mesh"].items()}  # the node axis gone
    for lay in stage["layers"]:
        lay.update({k: lay[k][1:] for k in ("input", "output") if lay[k] is not None})
        for w in lay["weights"]:
            w["placements"] = w["placements"][1:]
    figures = dict(chain=[0, 1], blocks=1, first_layer="a", last_layer="b", inflight=1, forward_s=0.0,
                   backward_s=0.0, boundary_forward_s=0.0, boundary_backward_s=0.0, boundary_planned_forward_s=0.0,
                   boundary_planned_backward_s=0.0, grad_sync_s=0.0, exposed_sync_s=0.0, optimizer_s=0.0, end_s=0.0,
                   memory_bytes=0.0, fits_memory=True)
    return dict(json.loads(json.dumps(plans["dp"])), strategy="searched (pipeline)", layers=[], edges=[],
                pipeline={"schedule": schedule, "split": list(split), "makespan_s": 0.0},
                stages=[dict(figures, plan=stage), dict(figures, plan=stage)])


def test_pipeline_stages_schedule_and_split(plans, monkeypatch):
    import autotune.apply.pipeplan
    monkeypatch.setattr(autotune.apply.pipeplan, "load_pipelined", lambda plan, origin=None: None)  # (a synthetic plan)
    piped = _piped(plans)
    lo = layout(Plan.from_dict(piped))
    assert (lo.pipeline, lo.data, lo.tensor, lo.schedule, lo.split) == (2, 4, 1, "gpipe", (1, 1))
    e = export(plan_file(piped), "torchtitan")
    assert e.cannot == () and "expresses this plan exactly" in e.text  # against its own plan: no baseline needed
    t = titan(e.config)
    assert t["parallelism.pipeline_parallel_degree"] == "2" and t["parallelism.pipeline_parallel_microbatch_size"] == "2"
    assert t["parallelism.pipeline_parallel_schedule"] == "GPipe"  # (torchtitan's default would be 1F1B)
    m = export(plan_file(piped), "megatron")
    assert "--pipeline-model-parallel-size 2" in m.config and megatron_known(m.config)
    assert m.cannot == ("the gpipe schedule: megatron has no such schedule (exported: 1F1B)",)
    uneven = dict(piped, model=dict(piped["model"], layers=3), pipeline=dict(piped["pipeline"], split=[2, 1]))
    flags = args_of(export(plan_file(uneven), "megatron").config)
    assert flags[flags.index("--decoder-first-pipeline-num-layers") + 1] == "2"
    job = torchtitan_reads(e.config)
    assert job.parallelism.module_fqns_per_model_part == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]
    assert job.parallelism.pipeline_parallel_schedule == "GPipe"
    assert "[['tok_embeddings', 'layers.0', 'layers.1'], ['layers.2', 'norm', 'lm_head']]" in str(
        torchtitan_reads(export(plan_file(uneven), "torchtitan").config).parallelism.module_fqns_per_model_part)


def test_plans_the_tools_cannot_run_are_refused(plans, tmp_path, capsys):
    for kind in ("mlp", "vgg13"):
        bad = dict(plans["dp"], model=dict(plans["dp"]["model"], kind=kind))
        with pytest.raises(UserError, match=f"the plan's model is '{kind}'.*transformer language models"):
            export(plan_file(bad), "torchtitan")
    with pytest.raises(UserError, match=r"stage split \[2, 2\] does not give its 2 stages"):
        export(plan_file(_piped(plans, split=(2, 2))), "megatron")  # 4 blocks of a 2-block model: hand-edited


def test_a_real_pipelined_plan_is_read_by_apply_pipelines_loader(tmp_path, capsys):
    """A searched 2-stage x 2-data-parallel plan: exported exactly; a split edited by hand is refused in one
    line, as apply_pipeline refuses it."""
    pytest.importorskip("torch")
    out = tmp_path / "p"
    assert main(["--model", "gpt", "--preset", "gpt3-1.3b", "--layers", "4", "--hidden", "256", "--heads", "4",
                 "--sequence", "128", "--vocabulary", "1024", "--batch", "16", "--micro-batch", "4", "--nodes", "2",
                 "--gpus-per-node", "2", "--profile", "h200-nvlink+ib400", "--budget", "0.3", "--compare", "none",
                 "--pipeline", "2", "--out", str(out)]) == 0
    pf = PlanFile.load(out / "plan.json")
    piped = pf.best if pf.best.stages else next(b for b in pf.baselines if b.stages)
    e = export(PlanFile(piped, []), "torchtitan")
    assert e.layout.pipeline == 2 and e.cannot == (), e.cannot
    d = PlanFile(piped, []).to_dict()
    d["best"]["pipeline"]["split"] = [3, 1]
    (tmp_path / "edited.json").write_text(json.dumps(d))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "edited.json"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "split [3, 1]" in err[0]


def test_bad_input(plans, tmp_path, capsys):
    pf = plan_file(plans["megatron"])
    with pytest.raises(OptionError):
        export(pf, "deepspeed")
    with pytest.raises(OptionError):
        export(pf, "megatron", "baseline:summa")
    with pytest.raises(UserError, match="recompute"):
        export(plan_file(dict(plans["megatron"], recompute="sometimes")), "megatron")
    with pytest.raises(UserError, match="layers"):
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
    from types import SimpleNamespace
    one = "\n".join(next_steps("p.json", SimpleNamespace(cluster=Cluster(1, 4), stages=(), allocator="default")))
    staged = "\n".join(next_steps("p.json", SimpleNamespace(cluster=Cluster(2, 8), stages=(1, 2), allocator="default")))
    assert 'model = autotune.apply("p.json", model)' in one and "apply_pipeline" not in one
    assert 'pipe = autotune.apply_pipeline("p.json", model)' in staged and "torchrun --nnodes 2" in staged
    assert "PYTORCH_CUDA_ALLOC_CONF" not in one + staged
    # a plan searched for expandable segments: the job started under them
    exp = "\n".join(next_steps("p.json", SimpleNamespace(cluster=Cluster(1, 4), stages=(),
                                                        allocator="expandable_segments")))
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nproc-per-node 4" in exp
    # a plan searched for a config.json: measured on its transformers class
    assert one.endswith("-m autotune execute p.json")
    assert next_steps("p.json", SimpleNamespace(cluster=Cluster(1, 4), stages=(), allocator="default"),
                      "c.json")[-1].endswith("-m autotune execute p.json --module c.json")


def test_block_recomputation(plans):
    """Megatron-LM's block method (each stage's first N blocks re-run) exported as its flags; torchtitan, which
    re-runs every block or every n-th, gets every block and says so."""
    dp = json.loads(json.dumps(plans["dp"]))
    dp.update(strategy="searched (blocks)", recompute="full", recompute_blocks=1)
    m = export(plan_file(dp, plans["dp"]), "megatron")
    flags = args_of(m.config)
    assert flags[flags.index("--recompute-method") + 1] == "block"
    assert flags[flags.index("--recompute-num-layers") + 1] == "1" and m.cannot == () and megatron_known(m.config)
    t = export(plan_file(dp, plans["dp"]), "torchtitan")
    assert titan(t.config)["ac"] == "full" and any("first 1 blocks" in c for c in t.cannot)


def test_interleaved_1f1b_and_zero(plans, monkeypatch):
    """Interleaved 1F1B and ZeRO-1 as each tool sets them: torchtitan's Interleaved1F1B over one model part per
    virtual stage (rank i's chunks i and i + p) and FSDP over the data ranks never resharding after forward (its
    ZeRO-2, said); Megatron-LM's virtual stages per rank and distributed optimizer, exactly."""
    import autotune.apply.pipeplan
    monkeypatch.setattr(autotune.apply.pipeplan, "load_pipelined", lambda plan, origin=None: None)  # (a synthetic plan)
    piped = _piped(plans, split=(2, 2), schedule="interleaved-1f1b")
    piped["model"] = dict(piped["model"], layers=4)
    for st in piped["stages"]:
        st["techniques"] = {"virtual_stages": 2, "zero_stage": 1}
    lo = layout(Plan.from_dict(piped))
    assert (lo.virtual, lo.chunks, lo.zero) == (2, (1, 1, 1, 1), 1)
    m = export(plan_file(piped), "megatron")
    flags = args_of(m.config)
    assert flags[flags.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert "--use-distributed-optimizer" in flags and megatron_known(m.config) and m.cannot == (), m.cannot
    t = export(plan_file(piped), "torchtitan")
    assert [c.split(":")[0] for c in t.cannot] == ["ZeRO-1 (optimizer states sharded)"]
    job = torchtitan_reads(t.config)
    assert job.parallelism.pipeline_parallel_schedule == "Interleaved1F1B"
    assert job.parallelism.module_fqns_per_model_part == [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"],
                                                          ["layers.3", "norm", "lm_head"]]
    assert (job.parallelism.data_parallel_shard_degree, job.parallelism.data_parallel_replicate_degree) == (4, 1)
    assert job.parallelism.fsdp_reshard_after_forward == "never"
