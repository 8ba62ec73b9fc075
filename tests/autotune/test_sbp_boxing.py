"""Boxing: the derived collectives really produce the target distribution (numpy simulation)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autotune.sbp.boxing import box, box_backward, copy_seconds, local_copies
from autotune.sbp.mesh import Cluster
from sbp_simulate import DistTensor

PLACEMENTS = ["B", "P", "S0", "S1"]


@st.composite
def cases(draw):
    cluster = Cluster(draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3, 4])))
    n = len(cluster.axis_sizes)
    src = tuple(draw(st.sampled_from(PLACEMENTS)) for _ in range(n))
    dst = tuple(draw(st.sampled_from(PLACEMENTS)) for _ in range(n))
    d = cluster.devices
    shape = (d * draw(st.integers(1, 2)), d * draw(st.integers(1, 2)))
    return cluster, shape, src, dst


@settings(max_examples=150, deadline=None)
@given(cases())
def test_boxing_reaches_target(case):
    cluster, shape, src, dst = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    for a, b in ((src, dst), (dst, src)):
        t = DistTensor.scatter(x, a, cluster, rng)
        assert t.check(x, a) == []
        t.execute(box(shape, 2, a, b, cluster))
        assert t.check(x, b) == []


def test_check_detects_a_wrong_distribution():
    cl = Cluster(1, 4)
    x = np.arange(64.0).reshape(8, 8)
    t = DistTensor.scatter(x, ("S0", "B"), cl, np.random.default_rng(0))
    assert t.check(x, ("S1", "B"))  # rows split, not columns
    assert t.check(x, ("B", "B"))


def test_paper_path_reduce_scatter_then_all_gather():
    # AutoDDL §4.3: (S0: p0, S1: p1, P: p2) -> (S0: p0, S1: p1*p2) -> (S0: p0, B: p1, S1: p2)
    cl = Cluster(1, 8)  # fine axes 2, 2, 2 = p0, p1, p2
    src, dst = ("S0", "S1", "P"), ("S0", "B", "S1")
    steps = box((16, 16), 2, src, dst, cl)
    assert [(s.op, s.axes) for s in steps] == [("reducescatter", (2,)), ("allgather", (1,))]
    # RS input: the local partial tensor 16/2 x 16/2 elements; AG output: 16/2 x 16/2
    assert [s.nbytes for s in steps] == [8 * 8 * 2, 8 * 8 * 2]
    back = box_backward((16, 16), 2, src, dst, cl)
    assert [(s.op, s.axes) for s in back] == [("reducescatter", (1,)), ("allgather", (2,))]


@pytest.mark.parametrize("src,dst,op", [
    (("P",), ("B",), "allreduce"), (("P",), ("S1",), "reducescatter"), (("S0",), ("B",), "allgather"),
    (("S0",), ("S1",), "alltoall"), (("B",), ("S0",), "slice"), (("B",), ("P",), "zero"),
])
def test_single_axis_transitions(src, dst, op):
    steps = box((8, 8), 4, src, dst, Cluster(1, 2))
    assert [s.op for s in steps] == [op]


@pytest.mark.parametrize("src,dst,copies,nbytes", [
    (("P",), ("B",), 1, 8 * 8 * 4),        # the functional all-reduce clones its input
    (("P",), ("S0",), 0, 8 * 8 * 4),       # reduce-scatter along dimension 0: in place
    (("P",), ("S1",), 1, 8 * 8 * 4),       # along 1: the input chunked into a contiguous buffer
    (("S0",), ("B",), 0, 8 * 8 * 4),       # all-gather along 0: the gathered buffer is the result
    (("S1",), ("B",), 1, 8 * 8 * 4),       # along 1: the chunks concatenated
    (("S0",), ("S1",), 1, 4 * 8 * 4),      # all-to-all: one side off dimension 0
    (("B",), ("S1",), 1, 8 * 4 * 4),       # a slice copies its piece out
    (("B",), ("P",), 0, 0),                # zeroing: not counted
])
def test_local_copies_around_each_step(src, dst, copies, nbytes):
    (step,) = box((8, 8), 4, src, dst, Cluster(1, 2))
    assert (local_copies(step), step.nbytes) == (copies, nbytes)
    assert copy_seconds((step,), lambda b: 1e-6 + b / 1e12) == pytest.approx(copies * (1e-6 + 2 * nbytes / 1e12))


def test_tiers_split_reduce_scatter_intra_first():
    cl = Cluster(2, 2)  # axis 0 inter, axis 1 intra
    steps = box((8, 8), 2, ("P", "P"), ("S0", "S0"), cl)
    assert [(s.op, s.axes, s.nbytes) for s in steps] == [("reducescatter", (1,), 128), ("reducescatter", (0,), 64)]
    t = DistTensor.scatter(np.ones((8, 8)), ("P", "P"), cl, np.random.default_rng(1)).execute(steps)
    assert t.check(np.ones((8, 8)), ("S0", "S0")) == []
