"""calibrate.health without MPI: the pair rounds, the outlier rule, the halving search on a simulated
cluster (a slow node, a slow link), the suspects, the record's round trip and its loader's refusals."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from calibrate.errors import UserError
from calibrate.health import HealthConfig, HealthRecord, Timed, flag_outliers, halving, round_robin, suspects


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
def test_round_robin_covers_every_pair_once_in_disjoint_rounds(n):
    rounds = round_robin(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    for r in rounds:
        nodes = [x for p in r for x in p]
        assert len(nodes) == len(set(nodes))
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)


def ring_time(slow_nodes=(), slow_links=(), factor=4.0):
    """A simulated cluster: a ring over nodes takes 1 s, ``factor`` s through a slow node or along a slow link
    (a link slows a ring only where its two nodes are neighbours in it)."""
    def measure(groups):
        out = []
        for g in groups:
            edges = {tuple(sorted((g[i], g[(i + 1) % len(g)]))) for i in range(len(g))}
            bad = set(g) & set(slow_nodes) or edges & {tuple(sorted(link)) for link in slow_links}
            out.append(factor if bad else 1.0)
        return out
    return measure


@pytest.mark.parametrize("n, culprit", [(8, 5), (16, 0), (16, 11), (6, 4)])
def test_halving_finds_a_slow_node(n, culprit):
    calls = []
    measure = ring_time(slow_nodes=[culprit])
    found = halving(list(range(n)), lambda gs: calls.append(gs) or measure(gs), lambda k: 1.0, 1.5)
    sus = suspects([str(i) for i in range(n)], [], [], found)
    assert [(s.kind, s.name) for s in sus] == [("node", str(culprit))]
    assert len(calls) <= 2 + math.ceil(math.log2(n))  # a few rounds, not n^2 pairs


def test_halving_stays_quiet_on_a_healthy_cluster_and_on_one_uniformly_slower_than_the_profile():
    found = halving(list(range(8)), ring_time(), lambda k: 1.0, 1.5)
    assert len(found) == 1 and not found[0].slow and not suspects(list("01234567"), [], [], found)
    slower = halving(list(range(8)), lambda gs: [3.0] * len(gs), lambda k: 1.0, 1.5)
    sus = suspects(list("01234567"), [], [], slower)
    assert [(s.kind, s.name) for s in sus] == [("group", "0,1,2,3,4,5,6,7")]


def pair_items(hosts, slow_pairs=(), slow_nodes=(), factor=4.0):
    out = []
    for a, b in itertools.combinations(hosts, 2):
        bad = {a, b} & set(slow_nodes) or (a, b) in slow_pairs
        out.append(Timed(f"{a}-{b}", [a, b], 0.01 * (factor if bad else 1.0), 0.01))
    flag_outliers(out, 1.5)
    return out


def test_a_slow_pair_is_named_and_a_slow_node_is_named_instead_of_its_pairs():
    hosts = ["n0", "n1", "n2", "n3"]
    sus = suspects(hosts, [], pair_items(hosts, slow_pairs=[("n1", "n2")]), [])
    assert [(s.kind, s.name) for s in sus] == [("pair", "n1-n2")]
    sus = suspects(hosts, [], pair_items(hosts, slow_nodes=["n3"]), [])
    assert [(s.kind, s.name) for s in sus] == [("node", "n3")]
    assert not suspects(hosts, [], pair_items(hosts), [])


def test_outliers_against_the_median_or_with_fewer_than_three_against_the_profile():
    items = [Timed(str(i), ["h"], t, 1.0) for i, t in enumerate([1.0, 1.1, 0.9, 2.0])]
    flag_outliers(items, 1.5)
    assert [t.slow for t in items] == [False, False, False, True]
    two = [Timed("a", ["h"], 1.4, 1.0), Timed("b", ["h"], 1.6, 1.0)]
    flag_outliers(two, 1.5)
    assert [t.slow for t in two] == [False, True]
    assert two[1].fraction == pytest.approx(1 / 1.6)
    fast = [Timed(str(i), ["h"], t, 10.0) for i, t in enumerate([1.0, 1.0, 1.0, 2.0])]
    flag_outliers(fast, 1.5)
    assert not any(t.slow for t in fast)  # twice its peers' time, yet five times faster than profiled


def record():
    hosts = ["node0", "node1", "node2"]
    pairs = pair_items(hosts, slow_pairs=[("node1", "node2")])
    ranks = [Timed(str(r), [hosts[r // 2]], 0.002, 0.001) for r in range(6)]
    return HealthRecord("2026-11-25T17:00:00", "p", HealthConfig().__dict__, hosts, 2, ranks, pairs, [],
                        suspects(hosts, ranks, pairs, []))


def test_record_round_trip_and_matrix(tmp_path):
    r = record()
    path = r.save(tmp_path / "h.json")
    assert not list(tmp_path.glob(".*tmp"))
    back = HealthRecord.load(path)
    assert back == r
    m = back.matrix()
    assert np.isnan(np.diag(m)).all() and m[1, 2] == m[2, 1] == pytest.approx(0.25) and m[0, 1] == pytest.approx(1.0)
    data = json.loads(path.read_text())
    assert data["kind"] == "commtune.health" and data["pairs"][0]["fraction"] == pytest.approx(1.0)


@pytest.mark.parametrize("edit, msg", [
    (lambda d: d.pop("hosts"), "'hosts' is missing"),
    (lambda d: d["pairs"][0].update(measured_s=float("nan")), "not a finite time"),
    (lambda d: d["pairs"][0].update(members=["node0", "node9"]), "does not join two of the hosts"),
    (lambda d: d["ranks"][0].update(slow="yes"), "'slow' is not true/false"),
    (lambda d: d["suspects"].append({"kind": "switch", "name": "x", "why": ""}), "a suspect"),
    (lambda d: d.update(version=9), "version 9"),
])
def test_loader_refuses_bad_records(tmp_path, edit, msg):
    d = record().to_dict()
    edit(d)
    path = tmp_path / "h.json"
    path.write_text(json.dumps(d))
    with pytest.raises(UserError, match=msg):
        HealthRecord.load(path)


@pytest.mark.parametrize("field, value, msg", [("iters", 0, "iters"), ("slow", 1.0, "slow"),
                                               ("search", "all", "search"), ("nbytes", 0, "nbytes")])
def test_config_refuses_bad_values(field, value, msg):
    with pytest.raises(UserError, match=msg):
        HealthConfig(**{field: value}).check()


def test_report_section_draws_the_pair_heat_map(tmp_path):
    from reports.sections import builder

    path = record().save(tmp_path / "h.json")
    (sec,) = builder("commtune.health")([path])
    html = "".join(sec.blocks)
    assert html.count("<svg") == 1 and "node1-node2" in html and "25%" in html
