"""Single-stage plans at the host's pace (``autotune.plan.hostpace``): each plan's step is at least its path's host
time, m n h_pass + n h_step (closed form, against the same command without host figures); the path read from the
plan (DDP, fully_shard, DTensor); and the measured 1.1 B Llama on 4 x H100 (session 13, run 12: the searched plan,
DTensor path, 496.7 ms measured against 293.5 predicted without host figures): with the host figures the command
prices it at 483 ms and returns the FSDP baseline (322.4 ms measured) instead."""
import os
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.__main__ import main as autotune_main
from autotune.plan.hostpace import at_host_pace
from autotune.plan.file import PlanFile
from calibrate.profile import Profile

RECORDS = os.path.join(os.path.dirname(__file__), "..", "..", "reports", "records")
H100 = os.path.join(RECORDS, "pipeline-gpu-2026-11-27", "profile.json")
H100_HOST = os.path.join(RECORDS, "pipeline-gpu-2026-11-27-s13", "profile-h100x4-host.json")
LLAMA_1B = ["--model", "llama", "--layers", "16", "--hidden", "2048", "--heads", "16", "--kv-heads", "4", "--ffn", "8192",
            "--sequence", "2048", "--vocabulary", "32000", "--batch", "32", "--micro-batch", "32", "--nodes", "1",
            "--gpus-per-node", "4", "--pipeline", "off", "--compare", "none"]
SMALL = ["--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
         "--sequence", "16", "--vocabulary", "256", "--batch", "16", "--micro-batch", "4", "--nodes", "1",
         "--gpus-per-node", "4", "--pipeline", "off", "--compare", "none"]


def plans(tmp_path, args, profile) -> dict:
    out = tmp_path / "out"
    assert autotune_main(args + ["--profile", str(profile), "--out", str(out)]) == 0
    pf = PlanFile.load(out / "plan.json")
    return {p.strategy: p for p in [pf.best] + pf.baselines}


def test_the_floor_closed_form(tmp_path):
    base = Profile.load("h200-nvlink")
    per_pass, per_step = 5e-3, 1e-3
    host = replace(base, compute=replace(base.compute, host_s={"ddp": (per_pass, per_step), "dtensor": (1e-9, 0.0),
                                                               "fully_shard": (1e-9, 0.0)}))
    path, bare = tmp_path / "host.json", tmp_path / "bare.json"
    host.save(path)
    # the devices' prices alone: host figures too small to bind (a profile without any plans by communication)
    replace(base, compute=replace(base.compute, host_s={k: (1e-12, 0.0) for k in ("ddp", "dtensor", "fully_shard")})
            ).save(bare)
    without = plans(tmp_path / "a", SMALL, bare)
    with_host = plans(tmp_path / "b", SMALL, path)
    dp = with_host["data parallel"]
    n, m = len(dp.model.graph().chain), dp.micro_batches
    assert dp.apply_path == "ddp" and m == 4
    assert dp.costs.host_step_s == pytest.approx(m * n * per_pass + n * per_step)
    assert dp.costs.step_s == pytest.approx(max(without["data parallel"].costs.step_s, m * n * per_pass + n * per_step))
    assert dp.costs.step_s > without["data parallel"].costs.step_s  # the host binds here
    fsdp = next(p for s, p in with_host.items() if s.startswith("FSDP"))
    assert fsdp.apply_path == "fully_shard"
    assert fsdp.costs.step_s == next(p for s, p in without.items() if s.startswith("FSDP")).costs.step_s
    assert at_host_pace(dp, None) is dp  # no compute figures: the plan as it is


def priced(tmp_path, recorded: str, host: bool) -> Path:
    """A profile of session 12 / 13 (before overlap figures existed) with the overlap at 1 (as it was priced then)
    and, without ``host``, host figures too small to bind: a copy the search plans several devices on by step."""
    p = Profile.load(recorded)
    compute = replace(p.compute, overlap={"all_reduce": 1.0, "all_gather": 1.0, "reduce_scatter": 1.0, "peer": "nccl"})
    if not host:
        compute = replace(compute, host_s={k: (1e-12, 0.0) for k in ("ddp", "dtensor", "fully_shard")})
    out = tmp_path / f"{'host' if host else 'bare'}.json"
    replace(p, compute=compute).save(out)
    return out


def test_the_measured_case_takes_a_local_path(tmp_path):
    before = plans(tmp_path / "a", LLAMA_1B, priced(tmp_path, H100, host=False))
    # the devices' prices alone put the search's own plan (the DTensor path's, its logits pass priced) and data
    # parallelism within 1% (the search's was the cheaper until that pass was priced, 2026-11-30)
    searched = next(p for s, p in before.items() if s.startswith("searched"))
    assert abs(searched.costs.step_s / before["data parallel"].costs.step_s - 1) < 0.01
    after = plans(tmp_path / "b", LLAMA_1B, priced(tmp_path, H100_HOST, host=True))
    best = next(p for s, p in after.items() if s.startswith("searched"))
    # a baseline on a local path replaces it: FSDP when its copies were not priced (run 12 measured FSDP there),
    # data parallel since they are (2 and 4 x H200, 2026-11-28: DDP measured faster than FSDP on this shape)
    assert best.strategy.startswith(("searched (the baseline FSDP", "searched (the baseline data parallel")) and \
        best.apply_path in ("fully_shard", "ddp")
    assert best.strategy.endswith("at the host's pace of the dtensor path it takes)")
    sb = after["S/B only (cd)"]
    assert sb.apply_path == "dtensor" and sb.costs.step_s == pytest.approx(sb.costs.host_step_s)
    assert 0.45 < sb.costs.step_s < 0.52  # the DTensor path's host, as run 12 measured the searched plan's


def test_tensor_path_prices_fully_shard_only_with_data_ranks():
    """Megatron on 4 devices at the host's pace: t = 4 (no data ranks: parallelize_module alone) takes the tensor
    path's figure; d = 2 x t = 2 (fully_shard over the 2 data ranks as well) that figure plus fully_shard's beyond
    the plain module's, per occurrence (closed form)."""
    from autotune.plan.build import build
    from autotune.plan.hostpace import data_ranks
    from autotune.sbp.baselines import megatron_assignment
    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.mesh import Cluster
    from models import load_model
    base = Profile.load("h200-nvlink")
    figures = {"tensor": (4e-3, 2e-4), "fully_shard": (3e-3, 5e-4), "none": (1e-3, 1e-4), "ddp": (1.5e-3, 1e-4),
               "dtensor": (9e-3, 1e-4)}
    shape = dict(layers=2, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=128, vocabulary=256, sequence=16,
                 batch=8, micro_batch=4)
    # without the plain module's figure ("none"), DDP's stands in for it
    without_none = {k: v for k, v in figures.items() if k != "none"}
    for host, plain in ((figures, figures["none"]), (without_none, figures["ddp"])):
        compute = replace(base.compute, host_s=host, host_outside_s={})
        problem = Problem(load_model("llama", None, shape), Coster(replace(base, compute=compute), Cluster(1, 4)),
                          require_fit=False, objective="step")
        both = (4e-3 + 3e-3 - plain[0], 2e-4 + 5e-4 - plain[1])
        for d, t, per in ((1, 4, figures["tensor"]), (2, 2, both)):
            plan = at_host_pace(build(problem, megatron_assignment(problem, (1, d), (1, t)), f"d={d} t={t}"), compute)
            n, m = len(plan.model.graph().chain), plan.micro_batches
            assert plan.apply_path == "tensor" and data_ranks(plan) == d and m == 2
            assert plan.costs.host_step_s == pytest.approx(m * n * per[0] + n * per[1])


def test_the_tensor_paths_outside_is_priced_by_its_own_figure():
    """A profile with the tensor path's figure outside the blocks (``host_outside_s``: the vocabulary-parallel
    embedding, head and loss): the chain's positions outside the blocks take it, spread; those inside the blocks
    keep the per-occurrence figure (closed form); sequence parallelism without a figure of its own takes the tensor
    path's."""
    from autotune.plan.build import build
    from autotune.plan.hostpace import occurrence_host
    from autotune.sbp.baselines import megatron_assignment
    from autotune.sbp.boxing import Coster
    from autotune.sbp.cost import Problem
    from autotune.sbp.mesh import Cluster
    from models import load_model
    base = Profile.load("h200-nvlink")
    per, whole = (4e-3, 2e-4), (0.03, 0.005)
    compute = replace(base.compute, host_s={"tensor": per, "none": (1e-3, 0.0)}, host_outside_s={"tensor": whole})
    shape = dict(layers=3, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=128, vocabulary=256, sequence=16,
                 batch=8, micro_batch=4)
    problem = Problem(load_model("llama", None, shape), Coster(replace(base, compute=compute), Cluster(1, 2)),
                      require_fit=False, objective="step")
    plan = at_host_pace(build(problem, megatron_assignment(problem, (1, 1), (1, 2)), "t=2"), compute)
    graph = plan.model.graph()
    inside = sum(end - start for start, end in graph.blocks)
    assert 0 < inside < len(graph.chain) and plan.micro_batches == 2
    assert plan.costs.host_step_s == pytest.approx(2 * (inside * per[0] + whole[0]) + inside * per[1] + whole[1])
    assert occurrence_host(graph, compute, None, "sequence") == occurrence_host(graph, compute, None, "tensor")
    assert sum(h[0] for h in occurrence_host(graph, compute, None, "none")) == pytest.approx(len(graph.chain) * 1e-3)


def test_residuals_correct_only_the_revision_they_were_fitted_against(tmp_path, capsys):
    """A profile's residuals divide the step model's predictions of one revision (``STEP_MODEL``): of that revision
    a plan's step is its uncorrected step times its path's factor; of another, or of none recorded, the plans are
    priced as without them and the search says so in one line; tune's refit keeps an earlier section's paths only
    where it is of the same revision."""
    from calibrate.residuals import Residuals, fitted
    from autotune.plan.hostpace import STEP_MODEL
    base = Profile.load("h200-nvlink")
    bare = plans(tmp_path / "bare", SMALL, "h200-nvlink")["data parallel"]
    got = {}
    for model in (STEP_MODEL, "2026-11-29", ""):
        path = tmp_path / f"r{model}.json"
        replace(base, residuals=Residuals({"ddp": 1.3}, "test", (), model)).save(path)
        capsys.readouterr()
        got[model] = plans(tmp_path / f"o{model}", SMALL, path)["data parallel"]
        stale = "the profile's residuals were fitted against" in capsys.readouterr().out
        assert stale == (model != STEP_MODEL)
    assert got[STEP_MODEL].costs.step_s == pytest.approx(1.3 * bare.costs.step_s)
    assert got[STEP_MODEL].costs.residual == 1.3
    assert got[""].costs.step_s == got["2026-11-29"].costs.step_s == bare.costs.step_s
    old = Residuals({"ddp": 1.3, "pipeline": 1.12}, "old", (), "2026-11-29")
    run = [{"path": "ddp", "predicted_s": 1.0, "measured_s": 1.1}]
    assert fitted(run, "new", old, STEP_MODEL).paths == {"ddp": 1.1}
    assert fitted(run, "new", replace(old, model=STEP_MODEL), STEP_MODEL).paths == {"ddp": 1.1, "pipeline": 1.12}
    assert Residuals.from_dict(fitted(run, "new", None, STEP_MODEL).to_dict()).model == STEP_MODEL


def test_a_recomputing_plan_takes_its_own_residual_else_its_paths(tmp_path):
    """A plan that recomputes is corrected by its path's recomputing key ("ddp/full") where tune measured one, else
    by its path's; a plan without recomputation never by the recomputing key; tune's refit keeps the keys apart;
    a key of no path or no recomputation is refused on load."""
    from calibrate.errors import UserError
    from calibrate.residuals import Residuals, fitted
    from autotune.plan.hostpace import STEP_MODEL, corrected, residual_path
    base = Profile.load("h200-nvlink")
    dp = plans(tmp_path, SMALL, "h200-nvlink")["data parallel"]
    full = replace(dp, recompute="full")
    assert (residual_path(dp), residual_path(full)) == ("ddp", "ddp/full")

    def factor(paths, plan):
        profile = replace(base, residuals=Residuals(paths, "test", (), STEP_MODEL))
        return corrected(plan, profile).costs.step_s / plan.costs.step_s

    both = {"ddp": 1.1, "ddp/full": 1.3}
    assert factor(both, dp) == pytest.approx(1.1) and factor(both, full) == pytest.approx(1.3)
    assert factor({"ddp": 1.1}, full) == pytest.approx(1.1)
    assert factor({"ddp/full": 1.3}, dp) == 1.0
    runs = [{"path": "ddp", "predicted_s": 1.0, "measured_s": 1.02},
            {"path": "ddp/full", "predicted_s": 1.0, "measured_s": 1.06},
            {"path": "ddp/full", "predicted_s": 2.0, "measured_s": 2.08}]
    got = fitted(runs, "test", None, STEP_MODEL)
    assert got.paths == pytest.approx({"ddp": 1.02, "ddp/full": 1.05})
    assert Residuals.from_dict(got.to_dict()).paths == got.paths
    for bad in ("ddp/none", "nvlink/full", "ddp/full/full"):
        with pytest.raises(UserError, match="residuals section"):
            Residuals.from_dict(dict(got.to_dict(), paths={bad: 1.1}))


def test_sequence_parallelisms_copies_are_priced(tmp_path):
    """With sequence parallelism, each all-gather and reduce-scatter of the stream copies it whole once (DTensor's
    collectives work along dimension 0, torch's styles split the sequence, dimension 1): per micro-batch 8 a block
    and 4 at the ends (the embedding's and the head's), as counted on 2 gloo ranks
    (``test_apply_sequence_parallel``), each a read and a write of the whole tensor; under full recomputation the
    block's forward ones again (4 a block); no other plan has them."""
    from autotune.plan.hostpace import sequence_copies_s
    from autotune.plan.layouts import sequence_axes
    two = SMALL[:SMALL.index("--nodes")] + ["--nodes", "1", "--gpus-per-node", "2", "--pipeline", "off", "--compare",
                                          "none", "--objective", "step"]
    got = plans(tmp_path, two, "h200-nvlink")
    sp = next(p for p in got.values() if sequence_axes(p))
    cm = Profile.load("h200-nvlink").compute
    copies = {(e.source, c.direction, c.collective): (e.count, c) for e in sp.edges for c in e.collectives
              if c.collective in ("allgather", "reducescatter")}  # the embedding's stream, read twice, moved once
    layers = sp.model.config["layers"]
    assert sum(n for n, _ in copies.values()) == 8 * layers + 4
    want = sp.micro_batches * sum(n * cm.memory_seconds(2 * c.nbytes) for n, c in copies.values())
    assert sp.costs.path_s == pytest.approx(want, rel=1e-12) and sequence_copies_s(sp, cm) == pytest.approx(want)
    assert sequence_copies_s(replace(sp, recompute="full"), cm) > want  # the blocks' forward ones again
    assert all(sequence_copies_s(p, cm) == 0 for p in got.values() if not sequence_axes(p))


def test_the_dtensor_paths_logits_gradient_pass_is_priced(tmp_path):
    """On the DTensor path each micro-batch's logits gradient is scaled to the whole batch's mean in a pass of its
    own (a read and a write of each local 16-bit logit) where the data ranks hold their own pieces: ``path_s``,
    in the step; DDP and fully_shard average inside their reductions (none)."""
    from autotune.plan.hostpace import path_work
    from autotune.plan.layouts import logits_data_axes
    got = plans(tmp_path, SMALL, "h200-nvlink")
    cm = Profile.load("h200-nvlink").compute
    dtensor = [p for p in got.values() if p.apply_path == "dtensor" and logits_data_axes(p)]
    assert dtensor, sorted(got)
    for p in dtensor:
        lay = p.layer("logits")
        split = 1
        for place, n in zip(lay.output, p.mesh.sizes):
            split *= n if place in ("S0", "S1") else 1
        want = p.micro_batches * cm.op_seconds("elementwise", 2 * 2 * lay.dims["tokens"] * lay.dims["n"] / split)
        assert p.costs.path_s == pytest.approx(want, rel=1e-12)
        bare = replace(p, costs=replace(p.costs, path_s=None, step_s=p.costs.step_s - want))
        assert path_work(bare, cm).costs.step_s == pytest.approx(p.costs.step_s, rel=1e-12)
    for p in got.values():
        if p.apply_path in ("ddp", "fully_shard"):
            assert p.costs.path_s is None and path_work(p, cm) is p
