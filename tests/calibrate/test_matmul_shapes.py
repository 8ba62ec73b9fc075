"""The measured matmul shape grid: exact on its points, trilinear in log2 shape on log
efficiency between them (closed form: an efficiency that is a power of m, k and n is
reproduced exactly anywhere inside), no figure outside it or beside a missing point, and
the compute model's use of it (forward in ``nn``, a linear layer's backward in ``nt`` and
``tn``; the flops band where the grid has no figure)."""
import dataclasses
import math

import pytest

from calibrate.compute import Band, ComputeModel
from calibrate.errors import UserError
from calibrate.matmul_shapes import ShapeTable
from calibrate.profile import Profile
from models import load_model

from autotune.sbp.baselines import data_parallel
from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import layer_seconds

AXIS = (1024, 2048, 4096, 8192)


def power_law(m, k, n, c=1e14, a=0.3, b=-0.1, g=0.2):
    return c * m ** a * k ** b * n ** g  # FLOP/s


def table(eff=power_law, layouts=("nn", "nt", "tn"), scale=None):
    scale = scale or {}
    return ShapeTable({lay: {(m, k, n): scale.get(lay, 1.0) * 2 * m * k * n / eff(m, k, n)
                             for m in AXIS for k in AXIS for n in AXIS} for lay in layouts})


def test_exact_on_the_grid_and_trilinear_between():
    t = table()
    assert t.seconds(2048, 4096, 1024) == pytest.approx(2 * 2048 * 4096 * 1024 / power_law(2048, 4096, 1024), rel=1e-12)
    for shape in ((3072, 1500, 5000), (1024, 6144, 8000), (1100, 1100, 1100)):
        assert t.seconds(*shape) == pytest.approx(2 * math.prod(shape) / power_law(*shape), rel=1e-9)


def test_no_figure_outside_or_beside_a_missing_point():
    t = table()
    assert t.seconds(512, 2048, 2048) is None
    assert t.seconds(2048, 2048, 16384) is None
    assert t.seconds(2048, 2048, 2048, "xx") is None
    holed = ShapeTable({"nn": {s: v for s, v in t.layouts["nn"].items() if s != (4096, 4096, 4096)}})
    assert holed.seconds(3000, 3000, 3000) is None
    assert holed.seconds(2048, 2048, 2048) is not None


def test_model_uses_the_grid_then_the_band():
    band = Band(1e15)
    cm = ComputeModel("t", "measured", 1e-6, 4e12, matmul={"2": band}, matmul_shapes={"2": table()})
    assert cm.matmul_seconds(2048, 2048, 2048, 2) == pytest.approx(2 * 2048 ** 3 / power_law(2048, 2048, 2048))
    assert cm.matmul_seconds(64, 64, 64, 2) == pytest.approx(band.seconds(2 * 64 ** 3, 1e-6))
    plain = ComputeModel("t", "measured", 1e-6, 4e12, matmul={"2": band})
    assert plain.linear_backward_seconds(2048, 1024, 4096, 2) == pytest.approx(2 * plain.matmul_seconds(2048, 1024, 4096, 2))


def test_linear_backward_reads_its_own_layouts():
    # nt 1.5x and tn 2x the power law's time at their own (m, k, n): a swapped layout or shape differs
    cm = ComputeModel("t", "measured", 1e-6, 4e12, matmul={"2": Band(1e15)},
                      matmul_shapes={"2": table(scale={"nt": 1.5, "tn": 2.0})})

    def t(m, k, n):
        return 2 * m * k * n / power_law(m, k, n)
    m, k, n = 2048, 1024, 4096
    assert cm.matmul_seconds(m, k, n, 2) == pytest.approx(t(m, k, n))
    assert cm.linear_backward_seconds(m, k, n, 2) == pytest.approx(1.5 * t(m, n, k) + 2.0 * t(k, m, n))
    assert cm.linear_backward_seconds(m, k, n, 2) != pytest.approx(2.0 * t(m, n, k) + 1.5 * t(k, m, n))


def test_round_trip_and_bad_points():
    cm = ComputeModel("t", "measured", 1e-6, 4e12, matmul={"2": Band(1e15)}, matmul_shapes={"2": table()})
    back = ComputeModel.from_dict(cm.to_dict())
    assert back.matmul_seconds(3000, 1500, 5000, 2) == pytest.approx(cm.matmul_seconds(3000, 1500, 5000, 2))
    for bad in ({"nn": [[1024, 1024, 0, 1e-3]]}, {"nn": [[1024.5, 1024, 1024, 1e-3]]}, {"xy": []}, []):
        d = cm.to_dict()
        d["matmul_shapes"] = {"2": bad}
        with pytest.raises(UserError, match="calibrate compute"):
            ComputeModel.from_dict(d)


def test_step_model_matmul_backward_from_the_grid():
    # an MLP on 4 devices, data parallel: each matmul (16 tokens x k x n) forward in nn, backward the
    # input gradient (16, n, k) in nt (1.5x) and the weight gradient (k, 16, n) in tn (2x)
    axis = (16, 32, 64, 128, 256, 512)
    shapes = ShapeTable({lay: {(m, k, n): f * 2 * m * k * n / 1e14 for m in axis for k in axis for n in axis}
                         for lay, f in (("nn", 1.0), ("nt", 1.5), ("tn", 2.0))})
    cm = ComputeModel("t", "measured", 1e-6, 1e12, matmul={"2": Band(1e13)}, matmul_shapes={"2": shapes})
    prof = dataclasses.replace(Profile.load("gcp-a100"), compute=cm)
    dims = [256, 512, 128]
    pr = Problem(load_model("mlp", None, {"dims": dims, "batch": 128, "micro_batch": 64}), Coster(prof, Cluster(1, 4)),
                 None, objective="step")
    a = data_parallel(pr)
    matmuls = [(v, op) for v, op in enumerate(pr.ops) if op.layer.kind == "matmul"]
    assert len(matmuls) == 2
    for (v, op), (k, n) in zip(matmuls, zip(dims, dims[1:])):
        f, b = layer_seconds(op, pr.choices[v][a[v]], pr.cluster, cm, 2)
        assert f == pytest.approx(2 * 16 * k * n / 1e14, rel=1e-12)
        assert b == pytest.approx(3.5 * f, rel=1e-12)
