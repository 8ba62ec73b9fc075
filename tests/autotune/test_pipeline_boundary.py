"""A stage boundary priced as it executes (``BoundaryPricer.boundary`` / ``route``: each rank's tile to its pair,
then the receiving submesh's redistribution; a partial output reduce-scattered on the sending submesh first)
against closed forms of the profile, and against the resharding planner's direct transfers (``planned``)."""
from dataclasses import replace

import pytest

from calibrate.collectives import Collective
from calibrate.errors import UserError
from calibrate.profile import Group
from autotune.pipeline.boundary import DIRECT, SCATTER, BoundaryPricer, sent_placement
from autotune.sbp.mesh import Cluster

SHAPE = (512, 256)
ITEM = 2
WHOLE = SHAPE[0] * SHAPE[1] * ITEM



def test_equal_placements_cost_the_tile_transfer_alone(profile):
    # two stages of 2 GPUs in one node, rows split on both: device i sends its half to device i of stage 1
    pricer = BoundaryPricer(profile, 8, ITEM)
    cl = Cluster(1, 2)
    pair = profile.time(Collective.SENDRECV, WHOLE / 2, Group(2, 1))
    fwd, bwd = pricer.boundary(SHAPE, ("S0",), ("S0",), ("S0",), cl, cl, 0)
    assert fwd == pytest.approx(pair, rel=1e-9) and bwd == pytest.approx(pair, rel=1e-9)
    # replicated on both sides (the gradient partial, its dual): each rank sends its whole copy, nothing else
    whole = profile.time(Collective.SENDRECV, WHOLE, Group(2, 1))
    fwd, bwd = pricer.boundary(SHAPE, ("B",), ("B",), ("P",), cl, cl, 0)
    assert fwd == pytest.approx(whole, rel=1e-9) and bwd == pytest.approx(whole, rel=1e-9)


def test_split_to_replicated_pays_the_receiving_all_gather(profile):
    pricer = BoundaryPricer(profile, 8, ITEM)
    cl = Cluster(1, 2)
    pair = profile.time(Collective.SENDRECV, WHOLE / 2, Group(2, 1))
    gather = profile.time(Collective.ALLGATHER, WHOLE, Group(2, 1))  # nccl-tests' size: the output
    scatter = profile.time(Collective.REDUCESCATTER, WHOLE, Group(2, 1))  # its input
    fwd, bwd = pricer.boundary(SHAPE, ("S0",), ("B",), ("P",), cl, cl, 0)
    assert fwd == pytest.approx(pair + gather, rel=1e-9)
    # backward: the partial gradient reduce-scattered to rows on stage 1, then each half sent back
    assert bwd == pytest.approx(scatter + pair, rel=1e-9)
    # the resharding planner's direct transfers are another figure: each stage-1 device receives both halves
    pf, _ = pricer.planned(SHAPE, ("S0",), ("B",), ("P",), cl, cl, 0)
    assert pf != pytest.approx(fwd, rel=1e-3) and pf >= pair * (1 - 1e-9)
    # a partial output into rows: reduce-scattered to rows on the sender, then each half sent; backward the
    # halves sent back and all-gathered (the gradient of the reduce-scatter)
    r = pricer.route(SHAPE, ("P",), ("S0",), ("S0",), cl, cl, 0)
    assert (r.name, r.sent) == (SCATTER, ("S0",))
    assert r.forward == pytest.approx(scatter + pair, rel=1e-9)
    assert r.backward == pytest.approx(pair + gather, rel=1e-9)


def test_partial_to_replicated_is_reduce_scattered_before_the_send(profile):
    # Megatron's scatter-gather: P -> B over a 2-GPU stage pair is the sender's reduce-scatter (to the features,
    # which the receiver does not split), half a tile sent, the receiver's all-gather; backward the partial
    # gradient reduce-scattered on the receiver, half sent back, all-gathered on the sender
    pricer = BoundaryPricer(profile, 8, ITEM)
    cl = Cluster(1, 2)
    shape = (8192, 4096)  # large enough that the halved send pays for the extra collective
    whole = shape[0] * shape[1] * ITEM
    half = profile.time(Collective.SENDRECV, whole / 2, Group(2, 1))
    gather = profile.time(Collective.ALLGATHER, whole, Group(2, 1))
    scatter = profile.time(Collective.REDUCESCATTER, whole, Group(2, 1))
    r = pricer.route(shape, ("P",), ("B",), ("P",), cl, cl, 0)
    assert (r.name, r.sent) == (SCATTER, ("S1",))
    assert r.forward == pytest.approx(scatter + half + gather, rel=1e-9)
    assert r.backward == pytest.approx(scatter + half + gather, rel=1e-9)
    assert pricer.boundary(shape, ("P",), ("B",), ("P",), cl, cl, 0) == (r.forward, r.backward)
    # the direct route sends the whole partial tile and all-reduces on the receiver: dearer here
    direct = (profile.time(Collective.SENDRECV, whole, Group(2, 1))
              + profile.time(Collective.ALLREDUCE, whole, Group(2, 1)))
    assert r.forward < direct
    # a small tensor: the extra collective's latency outweighs the halved send, the direct route is kept
    small = pricer.route(SHAPE, ("P",), ("B",), ("P",), cl, cl, 0)
    assert (small.name, small.sent) == (DIRECT, ("P",))
    assert small.forward == pytest.approx(profile.time(Collective.SENDRECV, WHOLE, Group(2, 1))
                                          + profile.time(Collective.ALLREDUCE, WHOLE, Group(2, 1)), rel=1e-9)


def test_a_partial_output_whose_features_do_not_split_crosses_whole(profile):
    # 255 features do not split over 2 devices and the receiver splits nothing: the direct route, the whole
    # partial tile sent and all-reduced on the receiver
    shape = (512, 255)
    assert sent_placement(shape, ("P",), ("B",), Cluster(1, 2)) is None
    assert sent_placement(shape, ("S0",), ("B",), Cluster(1, 2)) is None  # nothing partial: nothing to scatter
    nbytes = shape[0] * shape[1] * ITEM
    r = BoundaryPricer(profile, 8, ITEM).route(shape, ("P",), ("B",), ("P",), Cluster(1, 2), Cluster(1, 2), 0)
    assert (r.name, r.sent) == (DIRECT, ("P",))
    assert r.forward == pytest.approx(profile.time(Collective.SENDRECV, nbytes, Group(2, 1))
                                      + profile.time(Collective.ALLREDUCE, nbytes, Group(2, 1)), rel=1e-9)


def test_across_nodes_each_pair_on_its_own_nic_or_the_nodes_shared_one(profile):
    # stages of one whole node each: 8 pairs cross the inter-node tier at once, each with 1/8 of the tile; the
    # profile's inter tier is per GPU (one NIC each): the 8 sends run side by side, one hop's time
    assert profile.per("inter") == "gpu"
    node = Cluster(1, 8)
    fine = ("S0",) * len(node.axis_sizes)
    hop = profile.time(Collective.SENDRECV, WHOLE / 8, Group(2, 2))
    fwd, _ = BoundaryPricer(profile, 8, ITEM).boundary(SHAPE, fine, fine, fine, node, node, 0)
    assert fwd == pytest.approx(hop, rel=1e-9)
    # the same figures read per node (one NIC a node, AutoDDL's clusters): the 8 sends queue on its port
    shared = replace(profile, bandwidth_per={})
    assert shared.per("inter") == "node"
    fwd, _ = BoundaryPricer(shared, 8, ITEM).boundary(SHAPE, fine, fine, fine, node, node, 0)
    assert fwd == pytest.approx(8 * hop, rel=1e-9)
    inside = BoundaryPricer(profile, 16, ITEM).boundary(SHAPE, fine, fine, fine, node, node, 0)[0]
    assert fwd > inside  # the same stages as two halves of one 16-GPU node: the intra-node tier


def test_submeshes_of_different_shapes_are_refused(profile):
    with pytest.raises(UserError, match="same coordinates"):
        BoundaryPricer(profile, 8, ITEM).boundary(SHAPE, ("S0",), ("S0",), ("S0",), Cluster(1, 2), Cluster(1, 4), 0)
