"""Boxing costs computed a row at a time (numpy) equal the path walked one pair at a time."""
import itertools
import math

import numpy as np
import pytest

from calibrate.errors import UserError
from calibrate.profile import Profile
from autotune.sbp.boxing import Coster, box
from autotune.sbp.mesh import Cluster
from autotune.sbp.rowbox import RowBoxer, encode

PROFILE = Profile.load("gcp-a100")


@pytest.mark.parametrize("cluster,shape", [(Cluster(2, 4), (16, 8)), (Cluster(2, 6), (12, 6)), (Cluster(3, 2), (12, 12))])
def test_rows_equal_the_pairwise_path(cluster, shape):
    # every pair of placements in {B, P, S0, S1} per fine axis; where the first order does not divide the row
    # is NaN (the caller walks the other orders); elsewhere the cost is the walked path's to rounding
    coster = Coster(PROFILE, cluster)
    rb = RowBoxer(coster, 2)
    fines = list(itertools.product(("B", "P", "S0", "S1"), repeat=len(cluster.axis_sizes)))
    src = fines[::3]
    checked = nan = 0
    for s in src:
        try:
            box(shape, 2, s, s, cluster)
        except UserError:
            continue  # the source itself does not divide
        got = rb.cost(shape, np.array(encode(s)), np.array([encode(d) for d in fines]))
        for d, g in zip(fines, got):
            try:
                want = coster.time(box(shape, 2, s, d, cluster))
            except UserError:
                want = math.inf
            if math.isnan(g):
                nan += 1
                continue
            assert g == pytest.approx(want, rel=1e-12, abs=0), (s, d)
            checked += 1
    assert checked >= 40 and nan < checked / 5
