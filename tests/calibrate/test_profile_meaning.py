"""Profiles that mean what they say (issue 43): a tier's bandwidth per GPU or per node, priced as stated, and the
fragmentation allowance under the memory limit."""
import json

import pytest

from calibrate.collectives import Collective
from calibrate.errors import UserError
from calibrate.profile import DEFAULT_FRAGMENTATION, PER, Profile, embedded_profile_names
from autotune.sbp.boxing import Coster
from autotune.sbp.mesh import Cluster

GB = 2**30


def _ring_allreduce(p: int, nbytes: float, alpha: float, beta: float) -> float:
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


@pytest.mark.parametrize("name", embedded_profile_names())
def test_every_embedded_tier_states_its_scope_and_every_gpu_its_allowance(name):
    p = Profile.load(name)
    for tier in p.tiers:
        assert p.bandwidth_per[tier].value in PER and p.bandwidth_per[tier].source
    if p.device is not None:
        assert p.memory_bytes == int(p.device.usable_bytes * (1 - p.fragmentation_fraction))


def test_per_gpu_network_prices_one_nic_per_data_parallel_group():
    """ib400's 46 GB/s is each GPU's own NIC: 8 one-rank-per-node groups on 32 nodes x 8 GPUs each run at the
    figure (the ring's closed form), not at an eighth of it as a per-node figure would."""
    prof = Profile.load("h200-nvlink+ib400")
    seg = prof.tiers["inter"]["allreduce"]["2"].segments[0]
    coster = Coster(prof, Cluster(32, 8))
    want = _ring_allreduce(32, GB, seg.alpha, seg.beta)
    assert coster.group_time(Collective.ALLREDUCE, GB, 32, 32) == pytest.approx(want, rel=1e-9)
    # the same figure read per node: the node's one network shared by its 8 groups
    prof.bandwidth_per["inter"] = type(prof.bandwidth_per["inter"])("node", "test")
    node = Coster(prof, Cluster(32, 8)).group_time(Collective.ALLREDUCE, GB, 32, 32)
    assert node == pytest.approx(_ring_allreduce(32, 8 * GB, seg.alpha, seg.beta), rel=1e-9)
    assert node > 7 * want


def test_per_gpu_network_whole_node_group_uses_every_nic():
    """One group of all 256 GPUs of 32 nodes (8 a node): its inter-node traffic spreads over the node's 8 NICs."""
    prof = Profile.load("h200-nvlink+ib400")
    seg = prof.tiers["inter"]["allreduce"]["2"].segments[0]
    got = Coster(prof, Cluster(32, 8)).group_time(Collective.ALLREDUCE, GB, 256, 32)
    assert got == pytest.approx(_ring_allreduce(256, GB / 8, seg.alpha, seg.beta), rel=1e-9)


def test_fragmentation_allowance_is_kept_free_and_checked():
    prof = Profile.load("h100-nvlink+ib400")
    assert prof.fragmentation is not None and prof.fragmentation.source
    assert prof.memory_bytes == int(prof.device.usable_bytes * (1 - prof.fragmentation.value)) < prof.device.usable_bytes
    d = prof.to_dict()
    del d["memory_fragmentation"]
    assert Profile.from_dict(json.loads(json.dumps(d))).fragmentation_fraction == DEFAULT_FRAGMENTATION
    for bad in ({"fraction": 1.0, "source": "x"}, {"fraction": -0.1, "source": "x"}, {"fraction": 0.1}):
        with pytest.raises(UserError, match="memory_fragmentation"):
            Profile.from_dict(dict(d, memory_fragmentation=bad))
    with pytest.raises(UserError, match="bandwidth_per"):
        Profile.from_dict(dict(d, bandwidth_per={"inter": {"per": "rack", "source": "x"}}))


def test_expandable_segments_have_their_own_allowance():
    """The H200 profiles state the allowance measured under expandable segments beside the default allocator's; the
    limit of a plan searched for them keeps that much free (closed form), one without a figure for them keeps the
    default's; the figure round-trips and is checked as the other."""
    from calibrate.allocator import allocator_of
    prof = Profile.load("h200-nvlink+ib400")
    usable = prof.device.usable_bytes
    assert prof.fragmentation_expandable.value < prof.fragmentation.value
    assert prof.memory_bytes_under("expandable_segments") == int(usable * (1 - prof.fragmentation_expandable.value))
    assert prof.memory_bytes_under("default") == prof.memory_bytes == int(usable * (1 - prof.fragmentation.value))
    d = json.loads(json.dumps(prof.to_dict()))
    assert Profile.from_dict(d).fragmentation_expandable == prof.fragmentation_expandable
    del d["memory_fragmentation"]["expandable_segments"]
    assert Profile.from_dict(d).memory_bytes_under("expandable_segments") == prof.memory_bytes
    with pytest.raises(UserError, match="memory_fragmentation.expandable_segments"):
        Profile.from_dict(dict(d, memory_fragmentation=dict(d["memory_fragmentation"],
                                                            expandable_segments={"fraction": 2, "source": "x"})))
    with pytest.raises(UserError, match="allocator 'caching'"):
        prof.memory_bytes_under("caching")
    assert allocator_of({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"}) == \
        "expandable_segments"
    assert allocator_of({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) == allocator_of({}) == "default"


def test_new_profiles_cite_their_matmul_efficiency_per_shape():
    """The A100 and H100 profiles time matmuls per shape (points), below the datasheet peak, each with a source."""
    for name, best in (("a100-80gb-nvlink+hdr200", 267.9e12), ("h100-nvlink+ib400", 801e12)):
        c = Profile.load(name).compute
        band = c.matmul["2"]
        rates = [f / t for f, t in band.points]
        assert max(rates) == pytest.approx(best, rel=0.03) and max(rates) < band.peak_flops
        assert min(rates) < 0.2 * band.peak_flops  # small shapes are far below the peak
        assert c.sources["matmul.2"]
