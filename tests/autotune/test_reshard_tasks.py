from collections import Counter

import pytest

from autotune.reshard.cases import case_names, load_case
from kernels.reshard.spec import box_volume
from kernels.reshard.tasks import unit_tasks

N = 1024 * 1024 * 512


def _summary(case):
    c = load_case(case)
    units = unit_tasks(c.task)
    host = c.task.host
    return c, units, [(u.nbytes // 4, len({host(s) for s in u.senders}), len(u.senders),
                       len({host(r) for r in u.receivers}), len(u.receivers)) for u in units]


# (count, elements each or None, sender hosts, sender devices, receiver hosts, receiver devices)
EXPECTED = {
    "1": (2, N // 2, 1, 4, 1, 4),
    "2": (2, N // 2, 2, 8, 1, 4),
    "3": (4, N // 4, 1, 4, 1, 4),
    "4": (64, N // 64, 1, 1, 1, 1),
    "5": (4, N // 4, 2, 2, 1, 4),
    "6": (4, None, 1, 4, 1, 4),
    "7": (4, N // 4, 1, 1, 2, 8),
    "8": (1, N, 2, 6, 3, 6),
    "9": (4, N // 4, 1, 4, 1, 4),
}


@pytest.mark.parametrize("case", case_names())
def test_table2_unit_tasks(case):
    c, units, rows = _summary(case)
    count, elems, sh, sd, rh, rd = EXPECTED[case]
    assert len(units) == count
    assert sum(u.nbytes for u in units) == N * 4  # the unit tasks partition the tensor
    for e, a, b, x, y in rows:
        assert (a, b, x, y) == (sh, sd, rh, rd)
        if elems is not None:
            assert e == elems
    # every destination device gets exactly its tile
    need = Counter()
    for u in units:
        for r in u.receivers:
            need[r] += box_volume(u.box)
    for dev, box in c.task.dst_tiles().items():
        assert need[dev] == box_volume(box)


def test_case6_pieces_follow_the_padded_tiles():
    _, units, _ = _summary("6")
    rows = sorted(u.box[0] for u in units)
    assert rows == [(0, 342), (342, 512), (512, 684), (684, 1024)]
