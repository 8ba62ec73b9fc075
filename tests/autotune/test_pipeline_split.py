"""The stage DP (``best_split``) against brute force: every split of the blocks, each stage's time from a
table (random, with stages that do not fit), the estimate sum + (m - 1) max."""
import itertools
import math

import numpy as np
import pytest

from autotune.pipeline.split import best_split, estimate, window


def _brute(blocks, stages, time, m, lo, hi):
    best = None
    for split in itertools.product(range(lo, hi + 1), repeat=stages):
        if sum(split) != blocks:
            continue
        b, ts = 0, []
        for i, k in enumerate(split):
            ts.append(time(i, b, k))
            b += k
        if not all(math.isfinite(t) for t in ts):
            continue
        e = estimate(ts, m)
        if best is None or e < best[1] - 1e-12:
            best = (list(split), e)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    blocks, stages = int(rng.integers(4, 10)), int(rng.integers(2, 4))
    m = int(rng.integers(1, 9))
    lo, hi = window(blocks, stages, int(rng.integers(0, 3)))
    table = {}

    def time(i, b, k):  # stage i's time with k blocks after b: position-dependent, some over memory
        if (i, b, k) not in table:
            table[(i, b, k)] = math.inf if rng.random() < 0.1 else k * (1 + 0.3 * rng.random()) + 0.5 * (i == 0)
        return table[(i, b, k)]

    got = best_split(blocks, stages, time, m, lo, hi)
    want = _brute(blocks, stages, time, m, lo, hi)
    if want is None:
        assert got is None
    else:
        assert got is not None and got[1] == pytest.approx(want[1])
        b, ts = 0, []
        for i, k in enumerate(got[0]):
            ts.append(time(i, b, k))
            b += k
        assert sum(got[0]) == blocks and estimate(ts, m) == pytest.approx(want[1])


def test_balanced_when_stages_are_equal():
    split, e = best_split(12, 4, lambda i, b, k: float(k), 8, *window(12, 4, 2))
    assert split == [3, 3, 3, 3] and e == pytest.approx(12 + 7 * 3)


@pytest.mark.parametrize("seed", range(12))
def test_bounded_dp_equals_the_full_dp_and_times_fewer_entries(seed):
    """With a lower bound per entry (the time scaled down by up to 30%, inf where the time is), the DP finds the
    full DP's optimum and times only some of the entries."""
    rng = np.random.default_rng(100 + seed)
    blocks, stages, m = int(rng.integers(8, 16)), int(rng.integers(2, 5)), int(rng.integers(2, 12))
    lo, hi = window(blocks, stages, 2)
    table = {}

    def value(i, b, k):
        if (i, b, k) not in table:
            table[(i, b, k)] = math.inf if rng.random() < 0.1 else k * (1 + 0.3 * rng.random()) + 0.5 * (i == 0)
        return table[(i, b, k)]

    timed = set()

    def time(i, b, k):
        assert (i, b, k) not in timed  # each entry timed once
        timed.add((i, b, k))
        return value(i, b, k)

    full = best_split(blocks, stages, value, m, lo, hi)
    got = best_split(blocks, stages, time, m, lo, hi, lambda i, b, k: value(i, b, k) * (0.7 + 0.3 * ((i + b + k) % 2)))
    if full is None:
        assert got is None
    else:
        assert got is not None and got[1] == pytest.approx(full[1])
        assert len(timed) < len(table)


def test_bounded_dp_stops_at_a_split_of_timed_entries():
    """Exact bounds: one round times only the optimum's entries."""
    timed = []
    split, e = best_split(12, 4, lambda i, b, k: timed.append((i, b, k)) or float(k), 8, *window(12, 4, 2),
                          bound=lambda i, b, k: float(k))
    assert split == [3, 3, 3, 3] and sorted(timed) == [(0, 0, 3), (1, 3, 3), (2, 6, 3), (3, 9, 3)]


def test_cutoff_keeps_the_optimum_under_it_and_stops_above_it():
    def time(i, b, k):
        return float(k) + 0.1 * i
    split, e = best_split(12, 4, time, 8, *window(12, 4, 2))
    assert best_split(12, 4, time, 8, *window(12, 4, 2), cutoff=e * 1.001) == (split, e)
    assert best_split(12, 4, time, 8, *window(12, 4, 2), bound=time, cutoff=e * 1.001) == (split, e)
    assert best_split(12, 4, time, 8, *window(12, 4, 2), cutoff=e) is None


@pytest.mark.parametrize("m", [1, 2, 16])
def test_a_stage_that_does_not_fit_makes_the_estimate_inf_at_any_micro_batch_count(m):
    """Not NaN at one micro-batch (0 x inf): a NaN estimate compares false with every other, so the 3-D search's
    ``min`` over a (p, t, m)'s modes kept the plain plan that does not fit before a recomputed one that does."""
    assert estimate([1.0, math.inf], m) == math.inf
    assert estimate([1.0, 2.0], m) == 3.0 + (m - 1) * 2.0
