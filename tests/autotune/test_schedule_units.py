"""Schedule autotuner: bands, the model's split and correction, Spearman, choice per band."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.nccl.bands import Band, bands_for, parse_sizes
from autotune.schedule.choose import choose_band, correlations, finish, fixed_baseline, table
from autotune.schedule.model import Correction, copy_bytes, runtime_split, split_program
from calibrate.measure.stats import spearman
from autotune.schedule.result import NCCL, BandResult, CollectiveResult, Row, TableEntry
from autotune.schedule.space import Candidate
from calibrate.errors import UserError
from calibrate.profile import Profile
from kernels.gc3.algorithms import build
from kernels.gc3.compiler import compile_program
from kernels.gc3.simulate import simulate
from kernels.interp import pack


# ---- bands ---------------------------------------------------------------------------------
def test_parse_sizes_sweep_and_list():
    assert parse_sizes("1K:16K:4") == [1024, 4096, 16384]
    assert parse_sizes("64K, 1K,1M") == [1024, 65536, 1 << 20]


@pytest.mark.parametrize("bad", ["1K:1G", "1K:1G:x", "abc", "1K:1G:1", ","])
def test_parse_sizes_bad(bad):
    with pytest.raises(UserError):
        parse_sizes(bad)


def test_bands_edges_are_geometric_midpoints():
    assert bands_for([1024, 4096, 16384]) == [Band(1024, 0, 2048), Band(4096, 2048, 8192), Band(16384, 8192, 0)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 1 << 34), min_size=1, max_size=12, unique=True))
def test_bands_partition_all_sizes(sizes):
    bands = bands_for(sizes)
    assert bands[0].lo == 0 and bands[-1].hi == 0
    for a, b in zip(bands, bands[1:]):
        assert a.hi == b.lo
    for b in bands:
        assert [x for x in bands if x.covers(b.rep)] == [b]


# ---- model ---------------------------------------------------------------------------------
def _ring(ch=1, inst=1, proto="Simple"):
    return compile_program(build("ring_allreduce", 2, ch, inst, proto))


def _sent_bytes(program, nbytes):
    chunk = nbytes / program.nchunksperloop
    return sum(s.cnt * chunk for g in program.gpus for tb in g.threadblocks for s in tb.steps if s.type.sends)


@pytest.mark.parametrize("split", [1, 2, 8])
def test_split_program_moves_the_same_bytes_on_more_connections(split):
    p = _ring(2, 1)
    q = split_program(p, split)
    assert _sent_bytes(q, 1 << 20) == pytest.approx(_sent_bytes(p, 1 << 20))
    assert len(q.gpus[0].threadblocks) == split * len(p.gpus[0].threadblocks)
    conns = {(g.id, tb.send, tb.chan) for g in q.gpus for tb in g.threadblocks if tb.send >= 0}
    assert len(conns) == sum(tb.send >= 0 for g in q.gpus for tb in g.threadblocks)


def test_split_one_simulates_like_the_program():
    prof = Profile.load("gcp-a100")
    p = _ring()
    assert simulate(split_program(p, 1), 1 << 16, prof, 2) == simulate(p, 1 << 16, prof, 2)


def test_split_equals_compiler_instances_in_the_simulation():
    """split s of a 1-instance ring = the compiler's s instances (same messages, same links)."""
    prof = Profile.load("gcp-a100")
    a = simulate(split_program(_ring(1, 1), 4), 1 << 22, prof, 2)
    b = simulate(_ring(1, 4), 1 << 22, prof, 2)
    assert a == pytest.approx(b, rel=1e-9)


def test_runtime_split_matches_the_interpreter():
    p = _ring()   # 2 chunks
    assert runtime_split(p, 1 << 20, 4, 65536, 32) == pack.split_for((1 << 20) // 2, 65536, 32) == 8
    assert runtime_split(p, 1024, 4, 65536, 32) == 1
    assert runtime_split(p, 1 << 30, 4, 65536, 32) == 32


def test_copy_bytes_for_in_place_programs():
    assert copy_bytes(_ring(), 4096) == 4096
    ag = compile_program(build("ring_allgather", 2, 1, 1, "Simple"))
    assert copy_bytes(ag, 4096) == 2048


def test_correction_fit_recovers_an_exact_affine_law():
    pts = [("Simple", x, 3e-6 + 2.0 * x) for x in (1e-6, 5e-6, 2e-5)]
    pts += [("LL", x, 1e-6 + 1.5 * x) for x in (1e-6, 4e-6)]
    c = Correction.fit(pts)
    assert c.terms["Simple"] == pytest.approx((3e-6, 2.0), rel=1e-6)
    assert c.terms["LL"] == pytest.approx((1e-6, 1.5), rel=1e-6)
    again = Correction.from_dict(c.to_dict())
    assert again.terms["LL"] == pytest.approx(c.terms["LL"])
    assert Correction().apply("Simple", 5.0) == 5.0


def test_correction_needs_two_distinct_points():
    assert Correction.fit([("LL", 1e-6, 2e-6)]).terms == {}


def test_spearman_closed_forms():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swap of neighbours among 4: 1 - 6*2/(4*15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e3), st.floats(0, 1e3)), min_size=3, max_size=20))
def test_spearman_bounded_and_symmetric(pairs):
    x, y = [p[0] for p in pairs], [p[1] for p in pairs]
    r = spearman(x, y)
    if r is not None:
        assert -1 - 1e-9 <= r <= 1 + 1e-9
        assert spearman(y, x) == pytest.approx(r)


# ---- choice --------------------------------------------------------------------------------
def _band(rep, lo, hi, nccl, times, measured=None):
    rows = [Row(k, 1, t, t, model_us=t) for k, t in times.items()]
    b = BandResult(rep, lo, hi, nccl, rows)
    if measured is not None:
        b.nccl_measured_us = measured.pop(NCCL)
        for r in rows:
            if r.key in measured:
                r.measured_us, r.correct, r.selected = measured[r.key], True, True
    return b


def test_choose_band_uses_nccl_when_it_is_not_slower():
    b = _band(1024, 0, 2048, 5.0, {"a": 6.0, "b": 7.0})
    assert choose_band(b, measured=False) == NCCL
    b = _band(1024, 0, 2048, 9.0, {"a": 6.0, "b": 7.0})
    assert choose_band(b, measured=False) == "a"
    b = _band(1024, 0, 2048, 9.0, {"a": 6.0, "b": 7.0}, measured={NCCL: 10.0, "a": 12.0, "b": 8.0})
    assert choose_band(b, measured=True) == "b"
    b.row("b").correct = False   # a wrong result never wins
    assert choose_band(b, measured=True) == NCCL


def test_table_merges_neighbours_and_leaves_nccl_gaps():
    bands = [BandResult(1, 0, 2, 0, [], choice="a"), BandResult(3, 2, 4, 0, [], choice="a"),
             BandResult(5, 4, 6, 0, [], choice=NCCL), BandResult(7, 6, 8, 0, [], choice="a"),
             BandResult(9, 8, 0, 0, [], choice="b")]
    assert table(bands) == [TableEntry(0, 4, "a"), TableEntry(6, 8, "a"), TableEntry(8, 0, "b")]


def test_fixed_baseline_and_speedups_closed_form():
    # a: 1, 4 ; b: 2, 2 -> geomeans 2 and 2: tie broken by order (a first); tuned = 1, 2 (NCCL 3, 3)
    bands = [_band(1024, 0, 2048, 3.0, {"a": 1.0, "b": 2.0}), _band(4096, 2048, 0, 3.0, {"a": 4.0, "b": 2.0})]
    key, g = fixed_baseline(bands, measured=False)
    assert (key, g) == ("a", pytest.approx(2.0))
    cands = {k: Candidate(k, "library", 1, 1, "Simple", 65536, 8) for k in ("a", "b")}
    res = CollectiveResult("allreduce", cands, bands)
    finish(res, measured=False)
    assert [b.choice for b in res.bands] == ["a", "b"]
    assert res.summary["speedup_over_fixed_geomean"] == pytest.approx(math.sqrt(1.0 * 2.0))
    assert res.summary["speedup_over_nccl_geomean"] == pytest.approx(math.sqrt(3.0 * 1.5))
    assert res.summary["speedup_over_nccl_min"] == pytest.approx(1.5)


def test_correlations_with_a_protocol_switch_the_model_lacks():
    """Measured = per-protocol affine law of the simulation: the raw model misranks LL against
    Simple; the correction fitted on the other bands ranks every band perfectly."""
    proto = {"s1": "Simple", "s2": "Simple", "l1": "LL", "l2": "LL"}
    law = {"Simple": (8.0, 1.0), "LL": (0.5, 2.0)}
    bands = []
    for i, scale in enumerate((1.0, 2.0, 4.0)):
        sim = {"s1": 1 * scale, "s2": 3 * scale, "l1": 2 * scale, "l2": 4 * scale}
        meas = {k: law[proto[k]][0] + law[proto[k]][1] * v for k, v in sim.items()}
        bands.append(_band(1 << (10 + 2 * i), 0, 0, 100.0, sim, measured={NCCL: 100.0, **meas}))
    corr = correlations(bands, proto)
    for b in bands:
        assert b.spearman_corrected == pytest.approx(1.0)
    assert min(b.spearman for b in bands) < 0.8
    assert corr.terms["LL"] == pytest.approx((0.5e-6, 2.0), rel=1e-6)


def test_select_measures_the_best_of_each_protocol_and_the_contenders():
    from autotune.schedule.plan import select

    proto = {"s1": "Simple", "s2": "Simple", "s3": "Simple", "l1": "LL", "l2": "LL"}
    b1 = _band(1024, 0, 2048, 1.0, {"s1": 1.0, "s2": 2.0, "s3": 3.0, "l1": 4.0, "l2": 5.0})
    b2 = _band(4096, 2048, 0, 1.0, {"s1": 9.0, "s2": 2.0, "s3": 4.0, "l1": 4.5, "l2": 5.0})
    for b in (b1, b2):
        b.rows.sort(key=lambda r: r.predicted_us)
    select([b1, b2], 2, proto)
    # budget 2 -> top 2 overall + best 1 of each protocol + contenders (winners s1, s2; best geomeans s2, s1)
    assert {r.key for r in b1.rows if r.selected} == {"s1", "s2", "l1"}
    assert {r.key for r in b2.rows if r.selected} == {"s1", "s2", "s3", "l1"}
