"""The path a stage plan runs on and the host's floor under it (``autotune.pipeline.paths``): the floor's closed
form (the device's figures where the host is faster, n h_pass and n h_step where it is not, the forward and
backward scaled alike); the path read from the plan (ddp, fully_shard, tensor, dtensor, none) and the executor's own
reading (``autotune.apply.pipeplan.stage_paths``) agreeing; the chooser taking the data-parallel plan where the
searched one is on the DTensor path and slower at the host's pace; and the measured 2 x 2 case of
reports/records/pipeline.md (run 6 of session 12: 1158 ms on the DTensor path against 407 predicted): its
stages on DDP, with and without the host figures measured on that machine."""
import os
from dataclasses import replace

import pytest

from autotune.pipeline import paths
from autotune.pipeline.search import PipelineConfig, PipelineSearch, _at_host_pace
from autotune.pipeline.slicing import stage_graph, stage_spans, with_micro_batches
from autotune.pipeline.stage import StageProblem, _times, figures
from autotune.sbp.baselines import megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.memory import Mode
from autotune.sbp.mesh import Cluster
from calibrate.profile import Profile
from models import load_model

M = 4
RECORDS = os.path.join(os.path.dirname(__file__), "..", "..", "reports", "records")
H100 = os.path.join(RECORDS, "pipeline-gpu-2026-11-27", "profile.json")  # no host figures
H100_HOST = os.path.join(RECORDS, "pipeline-gpu-2026-11-27-s13", "profile-h100x4-host.json")  # the same + host_s
LLAMA_1B = dict(layers=16, hidden=2048, heads=16, kv_heads=4, ffn=8192, sequence=2048, vocabulary=32000, batch=32,
                micro_batch=32)


def with_host(profile, host: dict):
    return replace(profile, compute=replace(profile.compute, host_s=host))


def stage(graph, profile, i: int = 1, cluster=Cluster(1, 4), mode: Mode = Mode()) -> StageProblem:
    g = with_micro_batches(graph, M)
    span = stage_spans(g, [2, 2])[i]
    return StageProblem(stage_graph(g, *span), Coster(profile, cluster), None, mode=mode).in_flight(1)


@pytest.mark.parametrize("per_pass,per_step", [(1e-9, 1e-9), (0.5, 0.25)])
def test_host_floor_closed_form(graph, profile, per_pass, per_step):
    pr = stage(graph, with_host(profile, {"ddp": (per_pass, per_step)}))
    dp = paths.dp_assignment(pr)
    fwd, bwd, comp, red, sync, exposed, opt = _times(pr, dp)
    fig = figures(pr, dp)
    n = len(pr.graph.chain)
    assert fig.path == "ddp" and fig.host == pytest.approx(n * per_pass)
    assert fig.forward + fig.backward == pytest.approx(max(fwd + bwd, n * per_pass))
    assert fig.forward / fig.backward == pytest.approx(fwd / bwd)
    assert fig.optimizer == pytest.approx(max(opt, n * per_step))
    assert fig.compute == pytest.approx(comp + M * (fig.forward + fig.backward - fwd - bwd) + fig.optimizer - opt)
    assert (fig.redistribution, fig.grad_sync, fig.exposed_sync) == (red, sync, exposed)
    plain = figures(stage(graph, with_host(profile, {})), dp)  # no host figures: the device's, no path
    assert (plain.forward, plain.backward, plain.path) == (fwd, bwd, "")


def test_stage_path_reads_the_plan(graph, profile):
    pr = stage(graph, profile)
    dp = paths.dp_assignment(pr)
    assert paths.stage_path(pr, dp) == "ddp"
    assert paths.stage_path(pr.with_mode(Mode("none", (0, 1))), dp) == "fully_shard"
    tp = megatron_assignment(pr, (1, 2), (1, 2))
    # AutoDDL's graph (no residual stream) hands a partial sum across the boundary: DTensor's; a Llama's residual
    # stream whole on the tensor axis: torchtitan's PP + TP on the tensor path
    assert tp is not None and tp != dp and paths.stage_path(pr, tp) == "dtensor"
    llama = stage(load_model("llama", None, dict(LLAMA_1B, layers=4)), profile)
    assert paths.stage_path(llama, megatron_assignment(llama, (1, 2), (1, 2))) == "tensor"
    one = stage(graph, profile, cluster=Cluster(1, 1))
    assert paths.stage_path(one, paths.dp_assignment(one)) == "none"


def test_the_chooser_takes_the_local_path_at_the_host_pace(graph, profile):
    """A tensor-parallel stage plan (the tensor path, priced by the DTensor path's host figure where the profile
    has no tensor one) against the data-parallel one: kept where the profile has no host figures (the search's
    choice stands) or where DDP's host is the slower, replaced where the tensor-parallel one's host is."""
    def choose(host):
        pr = stage(graph, with_host(profile, host or {}))  # the embedded profile carries host figures: none here
        tp = megatron_assignment(pr, (1, 2), (1, 2))
        return _at_host_pace((pr, tp, {"algorithm": "cd"}), [pr])[1] == paths.dp_assignment(pr)
    assert not choose(None)
    assert not choose({"dtensor": (1e-9, 0.0), "ddp": (0.1, 0.0)})
    assert choose({"dtensor": (0.1, 0.0), "ddp": (1e-9, 0.0)})


def _llama_1b_plan(profile_path: str):
    graph = load_model("llama", None, LLAMA_1B)
    return PipelineSearch(graph, Cluster(1, 4), Profile.load(profile_path), 80 * 2**30, PipelineConfig(2)).run()


def test_the_measured_case_runs_on_ddp():
    """The search's 2 x 2 plan of the 1.1 B Llama (run 6: its embedding split by features and its logits by
    vocabulary, data-parallel blocks; then on the DTensor path, 2.6x slower than predicted) is on DDP in both
    stages; with the host figures measured on that machine it is the same plan, priced with DDP's floor, which
    its kernels outlast."""
    before = _llama_1b_plan(H100)
    assert [paths.stage_path(x.problem, x.assign) for x in before.plans] == ["ddp", "ddp"]
    first = before.plans[0].problem
    emb = first.choices[first.graph.chain[0]][before.plans[0].assign[first.graph.chain[0]]]
    assert set(emb.fine_out) == {"S1"}  # the embedding by features
    after = _llama_1b_plan(H100_HOST)
    assert [x.assign for x in after.plans] == [x.assign for x in before.plans] and after.step == before.step
    for x in after.plans:
        assert x.fig.path == "ddp" and 0 < x.fig.host < x.fig.forward + x.fig.backward


def test_the_executor_reads_the_same_paths(graph, profile):
    """``stage_path`` (from the strategies) and ``autotune.apply.pipeplan.stage_paths`` (from the typed plan, what
    apply_pipeline runs) agree on searched plans, with and without host figures, and on the Megatron 3-D
    candidates (tensor parallel: the tensor path on a Llama, DTensor's without the residual stream; data
    parallel, plain and FSDP)."""
    pytest.importorskip("torch")
    from autotune.pipeline import threed
    from autotune.pipeline.record import pipeline_plan
    from autotune.apply.pipeplan import load_pipelined, stage_paths
    llama = load_model("llama", None, LLAMA_1B)
    cases = [(graph, Cluster(2, 2), profile), (graph, Cluster(1, 4), with_host(profile, {"dtensor": (0.1, 0.0)})),
             (llama, Cluster(1, 4), Profile.load(H100)), (llama, Cluster(1, 4), Profile.load(H100_HOST))]
    seen = set()
    for g, cluster, prof in cases:
        search = PipelineSearch(g, cluster, prof, 80 * 2**30, PipelineConfig(2))
        best = search.run()
        p, sub, m = best.stages, best.sub, best.micro_batches
        data = ((sub.nodes, sub.gpus_per_node), (1, 1))
        fsdp = threed.stage_plans(search, p, sub, m, data, Mode("none", tuple(range(len(sub.axis_sizes)))))
        for c in [best, search.candidate(p, sub, m, search.balanced(p), fsdp)] + list(threed.candidates(search))[:12]:
            search.finish(c)
            ours = [paths.stage_path(x.problem, x.assign) for x in c.plans]
            assert stage_paths(load_pipelined(pipeline_plan(search, c, "test"))) == ours, c.name
            seen.update(ours)
    assert {"ddp", "fully_shard", "dtensor"} <= seen


def test_the_plan_record_and_report_name_each_stage_path():
    """With host figures the pipelined plan's record names each stage's path and host time, and the report's stage
    table shows them; without, neither."""
    from autotune.pipeline.record import pipeline_plan
    from reports.sections.pipeline import stage_table
    llama = load_model("llama", None, LLAMA_1B)
    for prof, want in ((H100_HOST, True), (H100, False)):
        search = PipelineSearch(llama, Cluster(1, 4), Profile.load(prof), 80 * 2**30, PipelineConfig(2))
        record = pipeline_plan(search, search.finish(search.run()), "test")
        assert [s.host_pass_s is not None for s in record.stages] == [want, want]
        assert [s.plan.apply_path for s in record.stages] == ["ddp", "ddp"] if want else True
        column = "apply path (host ms / micro-batch)"
        table = stage_table(record)
        assert (column in table.columns) == want
        if want:
            assert list(table[column]) == [f"ddp ({s.host_pass_s * 1e3:.3g})" for s in record.stages]
