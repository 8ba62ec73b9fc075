"""Boxing costs computed for many pairs at once (transition counts per class of axes) equal the path
walked one pair at a time, including the pairs whose first order does not divide (box's other orders)
and those with no evenly divisible path (inf)."""
import itertools
import math

import numpy as np
import pytest

from calibrate.errors import UserError
from calibrate.profile import Profile
from autotune.sbp.boxing import Coster, _path, box, copy_seconds
from autotune.sbp.mesh import Cluster
from autotune.sbp.rowbox import RowBoxer, encode

PROFILE = Profile.load("gcp-a100")


def mem(nbytes):
    return 1e-6 + nbytes / 2e12


def walked(coster, shape, s, d, copies=False):
    try:
        steps = box(shape, 2, s, d, coster.cluster)
    except UserError:
        return math.inf
    return coster.time(steps) + (copy_seconds(steps, mem) if copies else 0.0)


def first_order_divides(cluster, shape, s, d):
    try:
        _path(shape, 2, s, d, cluster, early_slices=True, gather_first=False)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("copies", [False, True])
@pytest.mark.parametrize("cluster,shape", [(Cluster(2, 4), (16, 8)), (Cluster(2, 6), (12, 6)), (Cluster(3, 2), (12, 12)),
                                           (Cluster(4, 2), (4, 6))])
def test_rows_and_tables_equal_the_pairwise_path(cluster, shape, copies):
    # every pair of placements in {B, P, S0, S1} per fine axis whose ends divide; the fourth case has many
    # pairs whose first order does not divide and some with no path at all; with ``copies``, DTensor's
    # local copies around the steps too (the step objective's boxing)
    coster = Coster(PROFILE, cluster)
    rb = RowBoxer(coster, 2, mem if copies else None)
    fines = [f for f in itertools.product(("B", "P", "S0", "S1"), repeat=len(cluster.axis_sizes))
             if math.isfinite(walked(coster, shape, f, f))]
    src = fines[::3]
    codes = np.array([encode(d) for d in fines])
    tab = rb.table(shape, np.array([encode(s) for s in src]), codes)
    kinds = {"finite": 0, "inf": 0, "other order": 0}
    for s, t in zip(src, tab):
        row = rb.cost(shape, np.array(encode(s)), codes)
        for d, g, r in zip(fines, t, row):
            want = walked(coster, shape, s, d, copies)
            assert g == pytest.approx(want, rel=1e-12, abs=0) or (math.isinf(want) and math.isinf(g)), (s, d)
            assert r == g
            kinds["inf" if math.isinf(want) else "other order" if not first_order_divides(cluster, shape, s, d)
                  else "finite"] += 1
    assert kinds["finite"] >= 40
    if shape == (4, 6):
        assert kinds["other order"] > 0 and kinds["inf"] > 0, kinds
