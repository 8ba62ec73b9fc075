import pytest

from autotune.reshard.cases import build_task
from kernels.reshard.spec import Mesh, ShardingSpec, box_volume, parse_mesh_shape
from calibrate.errors import UserError


def test_parse_notations():
    assert ShardingSpec.parse("S01RR").dims == ((0, 1), (), ())
    assert ShardingSpec.parse("RS^0R").dims == ((), (0,), ())
    assert ShardingSpec.parse("S_0RR").dims == ((0,), (), ())
    assert str(ShardingSpec.parse("S^{01}RR")) == "S01RR"


@pytest.mark.parametrize("bad", ["", "S2RR", "SRR", "S0S0R", "XRR"])
def test_bad_specs(bad):
    with pytest.raises(UserError):
        ShardingSpec.parse(bad)


def test_mesh_placement_and_hosts():
    m = Mesh.place((2, 3), 1, 4)
    assert m.devices == (4, 5, 6, 8, 9, 10)
    assert m.hosts == (1, 2)
    with pytest.raises(UserError, match="devices per host"):
        Mesh.place((2, 5), 0, 4)
    with pytest.raises(UserError, match="needs 4 devices"):
        Mesh((2, 2), (0, 1, 2), 4)
    assert parse_mesh_shape("(2,4)") == (2, 4)
    with pytest.raises(UserError):
        parse_mesh_shape("2,4,1")


def test_tiles_cover_tensor_with_padding():
    spec = ShardingSpec.parse("S0RR")
    mesh = Mesh.place((3, 4), 0, 4)
    tiles = spec.tiles((1024, 8, 2), mesh)
    rows = sorted({t[0] for t in tiles.values()})
    assert rows == [(0, 342), (342, 684), (684, 1024)]  # ceil(1024/3) = 342, last clipped
    s01 = ShardingSpec.parse("S01R").tiles((13, 5), Mesh.place((2, 2), 0, 2))
    assert sorted(t[0] for t in s01.values()) == [(0, 4), (4, 8), (8, 12), (12, 13)]
    assert sum(box_volume(t) for t in s01.values()) == 13 * 5


def test_bad_input_messages_name_the_problem():
    with pytest.raises(UserError, match="has 4 dimensions but the tensor"):
        build_task((2, 4), "S0RRR", (2, 4), "S0RR", (8, 8, 8), "float32", 4)
    with pytest.raises(UserError, match="finer than the dimension allows"):
        build_task((2, 4), "S01RR", (2, 4), "S0RR", (4, 8, 8), "float32", 4)
    with pytest.raises(UserError, match="dtype"):
        build_task((2, 4), "S0RR", (2, 4), "S0RR", (8, 8, 8), "floaty", 4)
