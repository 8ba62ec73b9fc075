"""Each apply path priced as torch runs it (2 x H200, 2026-11-28: reports/records/plans_h200x2.md): tensor
parallelism by torch's styles with Megatron's residual stream whole on the tensor axis, the stream's fp32 bytes
under autocast (the row-parallel layers' outputs all-reduced in bf16 forward, the stream's gradients in fp32
backward), the tensor path read from the plan and its host figure; DDP's gradients held twice under
gradient accumulation."""
import pytest

from calibrate.collectives import Collective
from calibrate.compute import host_figure
from calibrate.profile import Group, Profile
from models import load_model
from autotune.plan.layouts import plan_path, tp_layout
from autotune.plan.build import build as build_plan
from autotune.sbp.baselines import data_parallel, megatron_assignment
from autotune.sbp.boxing import Coster, copy_seconds
from autotune.sbp.cost import Problem
from autotune.sbp.memory import edge_bytes
from autotune.sbp.mesh import Cluster
from autotune.sbp.tables import edge_steps

H200 = Profile.load("h200-nvlink")
SHAPE = dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, vocabulary=1024, sequence=64, batch=8,
             micro_batch=4)


def problem(objective="step"):
    return Problem(load_model("llama", None, dict(SHAPE)), Coster(H200, Cluster(1, 2)), require_fit=False,
                   objective=objective)


def test_edge_bytes_follow_autocast():
    assert edge_bytes("matmul", "residual", 2) == (2, 4)  # a row-parallel output: bf16 out, the stream's grad back
    assert edge_bytes("rmsnorm", "matmul", 2) == (4, 4)  # the norm's fp32 output and its gradient
    assert edge_bytes("matmul", "attention", 2) == (2, 2)
    assert edge_bytes("rmsnorm", "matmul", 4) == (4, 4)


def test_megatron_keeps_the_stream_whole_and_data_parallel_exists():
    pr = problem()
    mega = megatron_assignment(pr, (1, 1), (1, 2))
    res = next(v for v, op in enumerate(pr.ops) if op.layer.kind == "residual")
    assert pr.choices[res][mega[res]].input.sbp == ("S0", "B")  # whole on the tensor role
    dp = data_parallel(pr)  # on a role of one device the whole stream is the split one's strategy
    assert dp is not None and build_plan(pr, dp, "data parallel").apply_path == "ddp"
    typed = build_plan(pr, mega, "Megatron")
    assert typed.apply_path == plan_path(typed) == "tensor" and tp_layout(typed).stream == "B"


def test_the_row_parallel_all_reduces_are_bf16_forward_and_fp32_backward():
    pr = problem()
    mega = megatron_assignment(pr, (1, 1), (1, 2))
    v = {op.layer.name: i for i, op in enumerate(pr.ops)}
    t = pr.tables.pair_direct(v["proj"], v["residual"], mega[v["proj"]], mega[v["residual"]])
    elems = SHAPE["micro_batch"] * SHAPE["sequence"] * SHAPE["hidden"]
    micro_batches = SHAPE["batch"] // SHAPE["micro_batch"]
    fwd, bwd = edge_steps(pr.choices[v["proj"]][mega[v["proj"]]], pr.choices[v["residual"]][mega[v["residual"]]],
                          pr.ops[v["proj"]].out_shape, pr.cluster, (2, 4))
    assert [(st.op, st.nbytes) for st in fwd + bwd] == [("allreduce", 2 * elems), ("allreduce", 4 * elems)]
    ar = [H200.time(Collective.ALLREDUCE, elems * b, Group(2)) for b in (2, 4)]
    copies = copy_seconds(fwd + bwd, H200.compute.memory_seconds)  # DTensor's clones around them
    assert t == pytest.approx(micro_batches * (sum(ar) + copies), rel=1e-9)
    plan = build_plan(pr, mega, "Megatron")  # the plan's own record sends the same bytes
    edge = next(e for e in plan.edges if (e.source, e.target) == ("proj", "residual"))
    assert sorted((c.direction, c.nbytes) for c in edge.collectives) == [("bwd", 4 * elems), ("fwd", 2 * elems)]
    comm = problem("comm")  # AutoDDL's objective keeps the activation type both ways
    assert comm.tables.pair_direct(v["proj"], v["residual"], mega[v["proj"]], mega[v["residual"]]) == \
        pytest.approx(micro_batches * 2 * ar[0], rel=1e-9)  # no copies: the communication objective's sum


def test_the_tensor_path_takes_the_dtensor_figure_where_it_has_none():
    figures = {"dtensor": (1.0, 2.0)}
    assert host_figure(figures, "tensor") == (1.0, 2.0)
    assert host_figure(dict(figures, tensor=(3.0, 4.0)), "tensor") == (3.0, 4.0)
    assert host_figure(figures, "ddp") is None
    assert "tensor" not in " ".join(H200.compute.missing_overheads())


def test_ddp_holds_the_first_buckets_beside_the_rebuilt_ones_and_accumulates_apart():
    one = dict(SHAPE, micro_batch=SHAPE["batch"])  # one micro-batch: the gradients are the buckets' views
    for shape, copies in ((SHAPE, 2), (one, 1)):
        pr = Problem(load_model("llama", None, dict(shape)), Coster(H200, Cluster(1, 2)), require_fit=False,
                     objective="step")
        plan = build_plan(pr, data_parallel(pr), "data parallel")
        grads = pr.memory_breakdown(data_parallel(pr)).gradients
        assert plan.apply_path == "ddp" and grads > 0
        assert plan.costs.memory_bytes == pytest.approx(pr.peak_memory(data_parallel(pr)) + copies * grads, rel=1e-12)
        assert plan.costs.memory["ddp_rebuilt_buckets_bytes"] == pytest.approx(grads, rel=1e-12)
        assert ("ddp_accumulation_bytes" in plan.costs.memory) == (copies == 2)
    mega = megatron_assignment(pr, (1, 1), (1, 2))  # another path: as the memory model has it
    assert build_plan(pr, mega, "Megatron").costs.memory_bytes == pytest.approx(pr.peak_memory(mega), rel=1e-12)
