"""Costs of data parallelism and Megatron against their closed forms."""
import math

import pytest

from calibrate.errors import UserError
from calibrate.profile import Profile
from models import load_model
from autotune.sbp.baselines import data_parallel, megatron_assignment
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.layers import PARAM_BYTES

PROFILE = Profile.load("gcp-a100")
DIMS = [64, 32, 128, 16, 8]
T = 16  # micro-batch tokens


def ar(nbytes, p, tier="intra"):
    seg = PROFILE.tiers[tier]["allreduce"]["2"].segments[0]
    return 2 * (p - 1) * seg.alpha + 2 * (p - 1) / p * nbytes * seg.beta


def mlp_problem(nodes=1, gpus=4, limit=None, batch=T):
    g = load_model("mlp", None, {"dims": DIMS, "batch": batch, "micro_batch": T})
    from autotune.sbp.mesh import Cluster
    return Problem(g, Coster(PROFILE, Cluster(nodes, gpus)), limit)


def test_data_parallel_is_one_gradient_all_reduce_per_weight():
    pr = mlp_problem()
    a = data_parallel(pr)
    expect = sum(ar(k * n * 2, 4) for k, n in zip(DIMS, DIMS[1:]))
    assert pr.cost(a) == pytest.approx(expect, rel=1e-12)
    # memory: all weights replicated (16 bytes a parameter and autocast's bf16 copy, 2), inputs split over 4
    mem = sum(k * n * (PARAM_BYTES + 2) + T // 4 * k * 2 for k, n in zip(DIMS, DIMS[1:])) + T // 4 * DIMS[-1] * 4  # + the loss's fp32 probabilities
    assert pr.memory_of(a) == pytest.approx(mem)


def test_data_parallel_across_nodes_uses_the_inter_tier():
    pr = mlp_problem(nodes=2, gpus=1)
    assert pr.cost(data_parallel(pr)) == pytest.approx(
        sum(ar(k * n * 2, 2, "inter") for k, n in zip(DIMS, DIMS[1:])), rel=1e-12)


def test_megatron_mlp_all_reduces_forward_and_backward_between_row_and_column_layers():
    # t = 4, d = 1: fc0 column, fc1 row (output partial), fc2 column (input replicated), fc3 row.
    # Edge fc1 -> fc2: all-reduce of T x DIMS[2] in the forward and of its gradient in the backward.
    # fc3's output is partial: the loss needs it whole, one forward all-reduce of T x DIMS[-1] (Megatron's g);
    # the loss is computed on every device, so its gradient is whole and the backward owes nothing there
    # (Megatron's f would all-reduce the gradient of fc0's input, which is the data: not computed).
    # No weight is replicated: no gradient sync.
    pr = mlp_problem(batch=2 * T)
    a = megatron_assignment(pr, (1, 1), (1, 4))
    assert pr.cost(a) == pytest.approx(2 * (2 * ar(T * DIMS[2] * 2, 4) + ar(T * DIMS[-1] * 2, 4)), rel=1e-12)


def test_megatron_with_data_parallel_adds_gradient_sync_over_d():
    pr = mlp_problem()
    a = megatron_assignment(pr, (1, 2), (1, 2))
    # gradient sync: one all-reduce per weight, each of its local (k*n/2) elements
    expect = 2 * ar(T // 2 * DIMS[2] * 2, 2) + ar(T // 2 * DIMS[-1] * 2, 2) \
        + sum(ar(k * n // 2 * 2, 2) for k, n in zip(DIMS, DIMS[1:]))
    assert pr.cost(a) == pytest.approx(expect, rel=1e-12)


def test_memory_limit_no_plan_fits_names_the_smallest():
    with pytest.raises(UserError, match="smallest needs"):
        mlp_problem(limit=10.0)


def test_memory_limit_excludes_plans():
    pr = mlp_problem()
    dp = data_parallel(pr)
    pr.memory_limit = pr.memory_of(dp) - 1
    assert math.isinf(pr.cost(dp))


def test_profile_missing_a_tier():
    from autotune.sbp.mesh import Cluster
    with pytest.raises(UserError, match="no intra tier"):
        Coster(Profile.load("piz-daint"), Cluster(2, 4))


def test_groups_crossing_nodes_share_the_node_network():
    # 2 nodes x 4 GPUs: a step over the node axis alone runs as 4 concurrent 2-rank groups, one per GPU of a node,
    # all through the same node network: its bandwidth term is 4 x a lone group's. A group of all 8 ranks (one
    # flat ring) has the network to itself; inside a node nothing is shared.
    from calibrate.collectives import Collective
    from calibrate.profile import Group
    from autotune.sbp.boxing import Step
    from autotune.sbp.mesh import Cluster
    cl = Cluster(2, 4)
    c = Coster(PROFILE, cl)
    node_axis, gpu_axes = (0,), (1, 2)
    n = 1 << 20
    assert c.step_time(Step("allgather", node_axis, n)) == pytest.approx(
        PROFILE.time(Collective.ALLGATHER, 4 * n, Group(2, 2)), rel=1e-12)
    assert c.step_time(Step("allreduce", (0, 1, 2), n)) == pytest.approx(
        PROFILE.time(Collective.ALLREDUCE, n, Group(8, 2)), rel=1e-12)
    assert c.step_time(Step("allgather", gpu_axes, n)) == pytest.approx(
        PROFILE.time(Collective.ALLGATHER, n, Group(4, 1)), rel=1e-12)
    seg = PROFILE.tiers["inter"]["allgather"]["2"].segments[0]
    lone = PROFILE.time(Collective.ALLGATHER, n, Group(2, 2))
    assert c.step_time(Step("allgather", node_axis, n)) - lone == pytest.approx(3 * 0.5 * n * seg.beta, rel=1e-9)


def test_a_profile_measured_with_the_groups_sharing_the_network_is_not_shared_again():
    # calibrate run measures its inter groups (one rank per node) all at once, one per rank of a node: on
    # 2 nodes x 2 ranks the profile's 2-rank inter model already holds 2 groups through each node's network,
    # and the plans' node-axis steps (2 such groups at once) cost what it measured, not twice its bandwidth term
    import copy
    from calibrate.collectives import Collective
    from calibrate.profile import Group
    from autotune.sbp.boxing import Step
    from autotune.sbp.mesh import Cluster
    shared = copy.deepcopy(PROFILE)
    for by_p in shared.tiers["inter"].values():
        by_p["2"].groups_per_node = 2
    n = 1 << 20
    assert Coster(shared, Cluster(2, 2)).step_time(Step("allgather", (0,), n)) == pytest.approx(
        shared.time(Collective.ALLGATHER, n, Group(2, 2)), rel=1e-12)
    # on 2 nodes x 4 ranks, 4 groups share it: twice what was measured
    assert Coster(shared, Cluster(2, 4)).step_time(Step("allgather", (0,), n)) == pytest.approx(
        shared.time(Collective.ALLGATHER, 2 * n, Group(2, 2)), rel=1e-12)
