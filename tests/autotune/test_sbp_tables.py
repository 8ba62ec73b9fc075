"""Boxing tables, local costs, dynamic programming and the split layer norm against closed forms."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from calibrate.errors import UserError
from calibrate.profile import Profile
from models import load_model
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem, edge_steps
from autotune.sbp.mesh import Cluster
from autotune.sbp.search import Budget, make_search

PROFILE = Profile.load("gcp-a100")


def mlp(cluster, dims=(96, 48, 192, 24), limit=None, lazy=False):
    g = load_model("mlp", None, {"dims": list(dims), "batch": 48, "micro_batch": 24})
    return Problem(g, Coster(PROFILE, cluster), limit, precompute_tables=not lazy)


def brute(problem):
    return min(problem.cost(list(a)) for a in itertools.product(*(range(n) for n in problem.sizes)))


@pytest.fixture(scope="module")
def small():
    return mlp(Cluster(2, 6))  # fine axes of sizes 2 | 2, 3: the canonical key must keep sizes and tiers apart


def test_tables_equal_direct_boxing_costs(small):
    # every memoised pair equals the cost of its own boxing path (canonical key is sound)
    for (a, b) in small.edge_counts:
        tab = small.edge_matrix(a, b)
        for i, j in itertools.product(range(small.sizes[a]), range(small.sizes[b])):
            try:
                fwd, bwd = edge_steps(small.choices[a][i], small.choices[b][j], small.ops[a].out_shape, small.cluster)
                want = small.mb * (small.coster.time(fwd) + small.coster.time(bwd))
            except UserError:
                want = math.inf
            assert tab[i, j] == pytest.approx(want, rel=1e-12) or (math.isinf(want) and math.isinf(tab[i, j]))


def test_lazy_rows_and_columns_equal_the_tables(small):
    lazy = mlp(Cluster(2, 6), lazy=True)
    assert not lazy.tables.precomputed
    for (a, b) in small.edge_counts:
        full = small.edge_matrix(a, b)
        for j in range(0, small.sizes[b], 5):
            np.testing.assert_array_equal(lazy.tables.column(a, b, j), full[:, j])
        for i in range(0, small.sizes[a], 5):
            np.testing.assert_array_equal(lazy.tables.row(a, b, i), full[i, :])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_local_cost_differences_are_total_cost_differences(small, data):
    assign = [data.draw(st.integers(0, n - 1)) for n in small.sizes]
    v = data.draw(st.integers(0, len(assign) - 1))
    i = data.draw(st.integers(0, small.sizes[v] - 1))
    loc = small.local(assign, v)
    other = list(assign)
    other[v] = i
    a, b = small.raw_cost(other), small.raw_cost(assign)
    if math.isfinite(a) and math.isfinite(b):
        assert loc[i] - loc[assign[v]] == pytest.approx(a - b, rel=1e-9, abs=1e-15)


def test_dynamic_programming_is_the_exhaustive_optimum():
    pr = mlp(Cluster(1, 8), dims=(64, 32, 128, 16, 8))
    dp = make_search("dp").run(pr, Budget(), np.random.default_rng(0))
    ex = make_search("exhaustive").run(pr, Budget(), np.random.default_rng(0))
    assert dp.cost == pytest.approx(ex.cost, rel=1e-12)
    assert dp.cost == pytest.approx(pr.cost(dp.assignment), rel=1e-12)
    assert dp.cost == pytest.approx(brute(mlp(Cluster(1, 8), dims=(64, 32, 128, 16, 8))), rel=1e-12)


def test_dynamic_programming_on_two_layers_is_the_table_minimum():
    # two matmuls and the loss; closed form: min over (i, j, k) of node0[i] + node1[j] + node2[k]
    # + table01[i, j] + table12[j, k]
    pr = mlp(Cluster(1, 4), dims=(32, 16, 8))
    t01, t12 = pr.edge_matrix(0, 1), pr.edge_matrix(1, 2)
    want = (pr.node[0][:, None, None] + pr.node[1][None, :, None] + pr.node[2][None, None, :]
            + t01[:, :, None] + t12[None, :, :]).min()
    assert want > 0  # the loss needs the last output whole: not free
    assert make_search("dp").run(pr, Budget(), np.random.default_rng(0)).cost == pytest.approx(want, rel=1e-12)


def test_dynamic_programming_under_a_binding_memory_limit_returns_a_plan_that_fits_and_a_bound():
    # the limit couples every layer: the relaxation's best plan that fits, at least the exhaustive optimum
    # under the limit, which its lower bound does not exceed
    pr = mlp(Cluster(1, 8), dims=(64, 32, 128, 16, 8))
    free = make_search("dp").run(pr, Budget(), np.random.default_rng(0))
    pr.memory_limit = (pr.min_memory + pr.memory_of(free.assignment)) / 2
    dp = make_search("dp").run(pr, Budget(), np.random.default_rng(0))
    ex = make_search("exhaustive").run(pr, Budget(), np.random.default_rng(0))
    assert pr.feasible(dp.assignment) and ex.cost > free.cost
    assert dp.cost >= ex.cost * (1 - 1e-12) and dp.bound <= ex.cost * (1 + 1e-12)
    assert dp.stopped.startswith("exact") == (dp.cost <= dp.bound * (1 + 1e-12))


def test_split_layer_norm_all_reduces_its_statistics_forward_and_backward():
    # (S0: r0, B: 1, S1: r2): per micro-batch two all-reduces (forward statistics, backward
    # gradient sums) of 2 fp32 per local token over r2; nothing else inside the layer.
    t, h = 64, 32
    g = load_model("gpt", None, {"layers": 1, "hidden": h, "heads": 4, "sequence": 16, "vocabulary": 128,
                                 "batch": 8, "micro_batch": 4})
    pr = Problem(g, Coster(PROFILE, Cluster(1, 8)), None)
    v = [op.layer.name for op in pr.ops].index("ln1")
    seg = PROFILE.tiers["intra"]["allreduce"]["2"].segments[0]

    def ar(nbytes, p):
        return 2 * (p - 1) * seg.alpha + 2 * (p - 1) / p * nbytes * seg.beta

    found = 0
    for i, s in enumerate(pr.choices[v]):
        if s.signature != "layernorm-split":
            continue
        r0, r1, r2 = (s.mesh.role_size(r) for r in range(3))
        assert r2 > 1
        want = pr.mb * 2 * ar(t // r0 * 2 * 4, r2)
        assert pr.node_redist[v][i] == pytest.approx(want, rel=1e-12)
        found += 1
    assert found >= 3
