"""nd-SBP notation, meshes and the errors for bad input."""
import pytest

from calibrate.errors import UserError
from autotune.sbp.mesh import Cluster, RoleMesh, role_meshes
from autotune.sbp.sbp import NdSbp, parse


def test_format_and_parse_round_trip_single_gpu_nodes():
    cl = Cluster(64, 1)
    s = parse("(S0: 2, B: 4, S1: 8)", cl)
    assert s.placements == ("S0", "B", "S1")
    assert s.format(cl) == "(S0: 2, B: 4, S1: 8)"
    assert s.fine(cl) == ("S0", "B", "B", "S1", "S1", "S1")


def test_tuple_form_for_several_gpus_per_node():
    cl = Cluster(4, 8)
    s = parse("(S0: (2, 4), B: (1, 2), S1: (2, 1))", cl)
    assert s.format(cl) == "(S0: (2, 4), B: (1, 2), S1: (2, 1))"
    # fine axes: nodes 2,2 then gpus 2,2,2
    assert s.fine(cl) == ("S0", "S1", "S0", "S0", "B")


def test_local_shape():
    cl = Cluster(1, 8)
    assert parse("(S0: 2, B: 2, S1: 2)", Cluster(8, 1)).check((8, 6), Cluster(8, 1)) == (4, 3)
    with pytest.raises(UserError, match="does not divide"):
        NdSbp(("S0", "S1"), RoleMesh(((1, 4), (1, 2)))).check((6, 8), cl)


def test_errors():
    cl = Cluster(2, 4)
    with pytest.raises(UserError, match="cluster has 8"):
        parse("(S0: (2, 4), B: (1, 2))", cl)
    with pytest.raises(UserError, match="splits dimension 2"):
        NdSbp(("S2", "B"), RoleMesh(((2, 1), (1, 4)))).check((8, 8), cl)
    with pytest.raises(UserError, match="plain size"):
        parse("(S0: 2, B: 4)", cl)
    with pytest.raises(UserError, match="unknown SBP placement"):
        NdSbp(("X", "B"), RoleMesh(((2, 1), (1, 4))))
    with pytest.raises(UserError, match="does not match the cluster"):
        RoleMesh(((4, 1), (1, 4))).roles_of_axes(cl)


def test_role_meshes_cover_every_factorisation():
    meshes = role_meshes(Cluster(4, 2), 3)
    # compositions of 2 node factors into 3 roles (6) x of 1 GPU factor (3)
    assert len(meshes) == 18
    assert all(m.role_size(0) * m.role_size(1) * m.role_size(2) == 8 for m in meshes)
