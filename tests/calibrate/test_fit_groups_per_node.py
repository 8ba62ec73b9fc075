"""How many groups crossed each node's network at once when a calibration measured them
(``groups_per_node``): recorded by the fit, checked on load, used by ``Profile.time``."""
import numpy as np
import pandas as pd
import pytest

from calibrate.cli.fit import fit_profile
from calibrate.collectives import Collective, ring_coefficients
from calibrate.errors import UserError
from calibrate.profile import Group, Profile

SIZES = [1 << 16, 1 << 18, 1 << 20, 1 << 22]
ALPHA, BETA = 1e-3, 1e-7  # one ring step, seconds per byte through one node's network


def _rows(kind, ranks, nodes, shared):
    """sendrecv's medians of ``ranks`` on ``nodes`` with ``shared`` groups through each node's network."""
    tier = "intra" if nodes == 1 else "inter"
    a, b = ring_coefficients(Collective.SENDRECV, ranks)
    return [{"group": f"{kind}:{ranks}x{nodes}", "tier": tier, "ranks": ranks, "nodes": nodes,
             "collective": "sendrecv", "bytes": n, "median_s": a * ALPHA + b * n * BETA * shared,
             "ci_lo_s": 0.0, "ci_hi_s": 1.0} for n in SIZES]


def _run(nodes, per_node):
    """A calibration of ``nodes`` x ``per_node`` ranks: world, intra and inter groups, each kind all at once."""
    world = nodes * per_node
    rows = _rows("world", world, nodes, 1) + _rows("intra", per_node, 1, 1) + _rows("inter", nodes, nodes, per_node)
    meta = {"nodes": nodes, "config": {"world_size": world, "mode": "host", "dtype": "float32", "hosts": []}}
    return meta, pd.DataFrame(rows)


def test_the_fit_records_how_many_groups_shared_each_node_network():
    prof, _, _ = fit_profile([_run(2, 4)], "t", 1, 2)
    inter = prof.tiers["inter"]["sendrecv"]
    assert inter["2"].groups_per_node == 4  # the inter groups: one per rank of a node, all at once
    assert inter["8"].groups_per_node == 1  # the world: alone
    assert prof.tiers["intra"]["sendrecv"]["4"].groups_per_node == 1
    # as measured: 4 groups at once; one group a node has the network to itself (a quarter of the bandwidth term)
    n = 1 << 21
    a, b = ring_coefficients(Collective.SENDRECV, 2)
    assert prof.time("sendrecv", n, Group(2, 2)) == pytest.approx(a * ALPHA + b * n * BETA * 4, rel=1e-6)
    assert prof.time("sendrecv", n, Group(2, 2), groups_per_node=4) == pytest.approx(
        prof.time("sendrecv", n, Group(2, 2)), rel=1e-12)
    assert prof.time("sendrecv", n, Group(2, 2), groups_per_node=1) == pytest.approx(a * ALPHA + b * n * BETA, rel=1e-6)
    # inside a node nothing is shared, whatever is asked
    assert prof.time("sendrecv", n, Group(4, 1), groups_per_node=3) == prof.time("sendrecv", n, Group(4, 1))
    again = Profile.from_dict(prof.to_dict())
    assert again.tiers["inter"]["sendrecv"]["2"].groups_per_node == 4


def test_runs_that_shared_the_network_differently_are_not_fitted_together():
    with pytest.raises(UserError, match="different numbers of groups"):
        fit_profile([_run(2, 4), _run(2, 2)], "t", 1, 2)


@pytest.mark.parametrize("bad", [0, 1.5, True, "2"])
def test_a_bad_groups_per_node_is_refused_on_load(bad):
    d = Profile.load("gcp-a100").to_dict()
    d["tiers"]["inter"]["allreduce"]["2"]["groups_per_node"] = bad
    with pytest.raises(UserError, match="groups_per_node"):
        Profile.from_dict(d)


def test_profiles_without_the_field_load_as_one_group_a_node():
    prof = Profile.load("gcp-a100")
    assert all(m.groups_per_node == 1 for colls in prof.tiers.values() for by_p in colls.values()
               for m in by_p.values())
    assert np.isfinite(prof.time("allreduce", 1 << 20, Group(2, 2), groups_per_node=2))
