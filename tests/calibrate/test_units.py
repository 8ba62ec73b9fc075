import json

import numpy as np
import pytest

from calibrate.collectives import Collective, busbw_factor, ring_coefficients
from calibrate.errors import UserError
from calibrate.fit import fit_piecewise, holdout, predict
from calibrate.profile import CollectiveModel, Group, Profile, Segment, embedded_profile_names
from calibrate.sizes import align, parse_size, sweep
from calibrate.measure.stats import median_ci, summarize


def test_parse_size_and_sweep():
    assert parse_size("1K") == 1024 and parse_size("64M") == 64 << 20 and parse_size("1G") == 1 << 30
    assert parse_size("4096") == 4096
    assert sweep(1024, 8192, 2) == [1024, 2048, 4096, 8192]
    fine = sweep(1 << 10, 1 << 30, 1.41421356)
    assert len(fine) == 41 and (1 << 24) in fine and (1 << 30) in fine  # no drift off the powers of two
    assert all(n % 128 == 0 for n in fine)  # sizes between them stay aligned
    with pytest.raises(UserError, match="swap"):
        sweep(8192, 1024, 2)
    with pytest.raises(UserError, match="positive"):
        sweep(0, 1024, 2)
    with pytest.raises(UserError, match="bad size"):
        parse_size("12Q")


def test_align_rounds_like_nccl_tests():
    # allgather of 1000 B float32 on 3 ranks: 250 elements -> 83 per rank -> 996 B
    assert align(Collective.ALLGATHER, 1000, 3, "float32") == (996, 83)
    assert align(Collective.ALLREDUCE, 1000, 3, "float32") == (1000, 250)


def test_busbw_factors_match_nccl_tests():
    assert busbw_factor(Collective.ALLREDUCE, 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor(Collective.ALLGATHER, 4) == pytest.approx(3 / 4)
    assert busbw_factor(Collective.BROADCAST, 4) == 1.0
    assert ring_coefficients(Collective.ALLREDUCE, 4) == (6.0, 1.5)


def test_median_ci_brackets_median():
    x = np.random.default_rng(0).normal(10, 1, 101)
    lo, hi = median_ci(x)
    assert lo < np.median(x) < hi
    s = summarize(x)
    assert s["min_s"] <= s["ci_lo_s"] <= s["median_s"] <= s["ci_hi_s"] <= s["max_s"]


def _synthetic(coll, p, segs, sizes):
    return np.array([predict(coll, p, segs, [n])[0] for n in sizes])


def test_piecewise_fit_recovers_known_segments():
    coll, p = Collective.ALLREDUCE, 4
    truth = [Segment(0, 2 ** 20, 5e-6, 1 / 20e9), Segment(2 ** 20, 2.0 ** 62, 12e-6, 1 / 200e9)]
    sizes = np.array([2 ** k for k in range(10, 31)], dtype=float)
    t = _synthetic(coll, p, truth, sizes)
    segs = fit_piecewise(coll, p, sizes, t)
    assert len(segs) == 2
    assert segs[0].alpha == pytest.approx(5e-6, rel=1e-3)
    assert 1 / segs[-1].beta == pytest.approx(200e9, rel=1e-3)
    val = holdout(coll, p, sizes, t)
    assert val.median_abs_rel_err < 1e-6 and val.max_abs_rel_err < 0.15  # only the size at the break misses


def test_fit_single_regime_equals_closed_form():
    # two points, one segment: the exact solution of the 2x2 system
    coll, p = Collective.ALLGATHER, 2
    n = np.array([1e3, 1e8])
    alpha, beta = 3e-6, 1 / 100e9
    a, b = ring_coefficients(coll, p)
    t = a * alpha + b * n * beta
    seg, = fit_piecewise(coll, p, n, t, min_points=2)
    assert seg.alpha == pytest.approx(alpha, rel=1e-6) and seg.beta == pytest.approx(beta, rel=1e-6)


def test_fit_rejects_bad_data():
    with pytest.raises(UserError, match="non-finite"):
        fit_piecewise(Collective.ALLREDUCE, 2, [1, 2, 3], [1e-6, float("nan"), 1e-6])
    with pytest.raises(UserError, match="at least 2"):
        fit_piecewise(Collective.ALLREDUCE, 2, [1], [1e-6])


def test_profile_roundtrip_and_tier_choice(tmp_path):
    prof = Profile.load("gcp-a100")
    path = prof.save(tmp_path / "p.json")
    again = Profile.load(path)
    assert again.to_dict() == prof.to_dict()
    intra = prof.time("allreduce", 1 << 30, Group(16, 1))
    inter = prof.time("allreduce", 1 << 30, Group(32, 2))
    assert inter > 10 * intra  # 100 Gb/s between nodes against NVLink
    assert prof.time("allreduce", 1 << 20, Group(1, 1)) == 0.0


def test_profile_closed_form_time():
    seg = Segment(0, 2.0 ** 62, 2e-6, 1e-10)
    prof = Profile("t", {"kind": "assumed"}, tiers={"intra": {"allreduce": {"2": CollectiveModel([seg])}}})
    p, n = 8, 1e6
    assert prof.time("allreduce", n, Group(p, 1)) == pytest.approx(2 * (p - 1) * 2e-6 + 2 * (p - 1) / p * n * 1e-10)
    with pytest.raises(UserError, match="no inter tier"):
        prof.time("allreduce", n, Group(8, 2))
    with pytest.raises(UserError, match="no allgather"):
        prof.time("allgather", n, Group(8, 1))


def test_profile_load_errors(tmp_path):
    with pytest.raises(UserError, match="unknown profile"):
        Profile.load("no-such-profile")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        Profile.load(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "commtune.profile", "version": 99}))
    with pytest.raises(UserError, match="version"):
        Profile.load(wrong)


def test_embedded_profiles_load():
    names = embedded_profile_names()
    assert {"h200-nvlink", "h200-nvlink+ib400", "ib400", "piz-daint", "gcp-a100"} <= set(names)
    for n in names:
        Profile.load(n)
    h = Profile.load("h200-nvlink")
    assert h.provenance["kind"] == "measured" and h.tiers["intra"]["allreduce"]["2"].points


def test_gap_between_segments_blends_geometrically():
    # measured up to 1 MiB on one segment and from 2 MiB on the next: in between the
    # prediction is the log-distance-weighted geometric mean of both segments
    coll, p = Collective.SENDRECV, 2
    lo = Segment(0, 1.5 * 2 ** 20, 5e-6, 1e-11, {"first_bytes": 1024.0, "last_bytes": 2.0 ** 20})
    hi = Segment(1.5 * 2 ** 20, 2.0 ** 62, 20e-6, 1e-11, {"first_bytes": 2.0 ** 21, "last_bytes": 2.0 ** 30})
    model = CollectiveModel([lo, hi])
    n = 2 ** 20 * 2 ** 0.25  # a quarter of the way across the gap, in log size
    expect = lo.time(coll, n, p) ** 0.75 * hi.time(coll, n, p) ** 0.25
    assert model.time(coll, n, p) == pytest.approx(expect, rel=1e-12)
    # on measured sizes and inside a segment's own range, the segment alone
    assert model.time(coll, 2.0 ** 20, p) == pytest.approx(lo.time(coll, 2.0 ** 20, p), rel=1e-12)
    assert model.time(coll, 2.0 ** 21, p) == pytest.approx(hi.time(coll, 2.0 ** 21, p), rel=1e-12)
    assert model.time(coll, 4096, p) == lo.time(coll, 4096, p)
    # segments without the measured extent (older profiles) keep the hard break
    bare = CollectiveModel([Segment(0, 1.5 * 2 ** 20, 5e-6, 1e-11), Segment(1.5 * 2 ** 20, 2.0 ** 62, 20e-6, 1e-11)])
    assert bare.time(coll, n, p) == lo.time(coll, n, p)


@pytest.mark.parametrize("per_call, iters, want", [(7e-6, 20, 256), (1e-4, 20, 20), (2e-5, 20, 64), (1e-9, 20, 4096),
                                                   (7e-6, 300, 300)])
def test_batch_length_reaches_the_least_duration_in_a_power_of_two(per_call, iters, want):
    """1 ms of 7 us calls is 143 calls: 256; 20 calls of 100 us already last 2 ms."""
    from calibrate.measure.engine import batch_calls

    got = batch_calls(per_call, iters, 1e-3)
    assert got == want
    assert got * per_call >= 1e-3 or got in (iters, 4096)


def test_odd_multiples_are_aligned_to_the_unit_and_nothing_larger():
    from calibrate.sizes import odd_multiple

    assert [odd_multiple(n, 512) for n in (1, 1408, 2816, 5632, 90112)] == [512, 1536, 2560, 5632, 90624]
    for n in sweep(1408, 1 << 30, 2):
        m = odd_multiple(n, 512)
        assert m % 512 == 0 and (m // 512) % 2 == 1 and abs(m - n) <= 512
    with pytest.raises(UserError, match="size_unit"):
        odd_multiple(100, 0)


def test_despike_takes_a_one_size_spike_or_dip_at_the_median_and_keeps_a_step():
    from calibrate.fit import despike

    assert despike(np.array([5.0, 5.1, 4.0, 5.2, 5.3])).tolist() == [5.0, 5.0, 5.1, 5.2, 5.3]   # a dip
    assert despike(np.array([5.0, 9.0, 5.1])).tolist() == [5.0, 5.1, 5.1]                      # a spike
    step = np.array([5.0, 5.1, 5.2, 8.0, 8.1, 8.2])
    assert despike(step).tolist() == step.tolist()


def test_monotone_pools_small_falls_into_their_mean_and_keeps_real_ones():
    from calibrate.fit import monotone
    assert monotone(np.array([1.0, 3.0, 2.0, 4.0]), floor=1.0).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert monotone(np.array([3.0, 2.0, 1.5]), floor=1.0).tolist() == pytest.approx([13 / 6] * 3)
    rising = np.array([1.0, 1.0, 2.0, 5.0])
    assert monotone(rising).tolist() == rising.tolist()
    assert monotone(np.array([1.00, 0.99, 1.2])).tolist() == pytest.approx([0.995, 0.995, 1.2])   # noise: 1%
    step_down = np.array([1.0, 1.1, 0.8, 0.9])                                                  # NCCL switches late
    assert monotone(step_down).tolist() == step_down.tolist()


@pytest.mark.parametrize("method", ["interpolate", "segments"])
def test_a_fit_of_noisy_flat_times_does_not_fall_with_the_size(method):
    from calibrate.fit import fit_curve
    # a loaded host: latency-bound times that wander down and up by a few parts in a thousand (CI, 2026-11-27)
    n = np.array([1024 * 2 ** i for i in range(8)], dtype=float)
    t = 0.016 * np.array([1.0004, 1.0, 1.0003, 0.9990, 0.9985, 1.0001, 0.9992, 1.0010])
    segs = fit_curve(method, Collective.ALLREDUCE, 4, n, t)
    grid = np.geomspace(512, 4 * n[-1], 200)
    pred = predict(Collective.ALLREDUCE, 4, segs, grid)
    assert np.all(np.diff(pred) >= -1e-12 * pred[:-1]), "the fitted time falls with the size"
