"""The compute model's confirmatory evaluation on the CPU stand-in: held-out shapes declared off the
development grid and hash-checked, measured through the engine against the model's prediction,
checked before and after timing, rendered from the record."""
import dataclasses
import json

import pytest

from calibrate.cli import compute_evaluate as ce
from calibrate.cli.compute import development_grid
from calibrate.cli.compute_evaluate import main as compute_main
from calibrate.computeeval import EvaluateRecord, HeldoutRecord, Row, draw_shapes, summary
from calibrate.errors import UserError
from calibrate.layers import KINDS as LAYER_KINDS
from calibrate.measure.engine import Solo, Status, compare
from calibrate.measure.torcharm import TorchArm, medians, timing
from calibrate.profile import Profile

torch = pytest.importorskip("torch")
SMALL = ["--count", "2", "--matmul-range", "32,256", "--unit", "16", "--seq-range", "64,192", "--tokens", "256",
         "--layers", "64x256"]
FAST = ["--dtype", "fp32", "--device", "cpu", "--rounds", "3", "--calls", "2", "--min-batch-ms", "0", "--warmup", "1"]


@pytest.fixture
def declared(tmp_path):
    path = tmp_path / "heldout.json"
    assert compute_main(["declare", "--out", str(path), *SMALL]) == 0
    return path


@pytest.fixture
def profile(tmp_path):
    """An embedded profile's compute model with layer figures for two kinds (the others: no prediction)."""
    p = Profile.load("h200-nvlink")
    p.compute = dataclasses.replace(p.compute, layer_s={"layernorm": (1e-10, 2e-10), "gelu": (3e-10, 5e-10)},
                                    layer_call_s={})
    return p.save(tmp_path / "profile.json")


def test_declared_shapes_are_off_the_grid_and_hashed(declared):
    grid = development_grid()
    rec = HeldoutRecord.load(declared)
    shapes = rec.declaration.extra["shapes"]
    assert len(shapes["matmul"]) == 2 and len(shapes["sdpa"]) == 2 and shapes["layers"] == [[64, 256]]
    assert not {tuple(x) for x in shapes["matmul"]} & set(grid.matmul)
    assert all(m % 16 == 0 and 32 <= m <= 256 for x in shapes["matmul"] for m in x)
    data = json.loads(declared.read_text())
    data["heldout"]["extra"]["shapes"]["matmul"][0][0] += 16
    declared.write_text(json.dumps(data))
    with pytest.raises(UserError, match="hash"):
        HeldoutRecord.load(declared)


def test_a_shape_on_the_grid_cannot_be_held_out(tmp_path):
    grid = development_grid()
    with pytest.raises(UserError, match="development measures these sizes"):
        draw_shapes(grid, 0, 1, (32, 64), (64, 128), 256, [grid.layers[0]], 16)
    # only grid shapes to draw from: refused, not silently short
    with pytest.raises(UserError, match="cannot be drawn"):
        draw_shapes(grid, 0, 1, (256, 256), (64, 128), 256, [], 256)


def test_evaluate_on_the_cpu_stand_in(declared, profile, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert compute_main(["evaluate", "--heldout", str(declared), "--profile", str(profile), "--out", str(out),
                         *FAST]) == 0
    rec = EvaluateRecord.load(out)
    assert rec.basis == "evaluation" and rec.heldout["sha256"] == HeldoutRecord.load(declared).heldout["sha256"]
    model = Profile.load(profile).compute
    mm = [r for r in rec.rows if r.item == "matmul"]
    assert len(mm) == 2 and all(r.status == "ok" and r.measured_s > 0 for r in mm)
    for r in mm:
        m, k, n = (int(x) for x in r.shape.split(" x "))
        assert r.predicted_s == pytest.approx(model.matmul_seconds(m, k, n, 4))
        assert r.rel_err == pytest.approx((r.predicted_s - r.measured_s) / r.measured_s)
    sdpa = [r for r in rec.rows if r.item == "sdpa"]
    assert [r.part for r in sdpa] == ["forward", "backward"] * 2 and all(r.status == "ok" for r in sdpa)
    layers = {(r.shape.split(" @ ")[0], r.part): r for r in rec.rows if r.item == "layer"}
    assert layers[("gelu", "backward")].status == "ok" and layers[("gelu", "backward")].predicted_s > 0
    rms = layers[("rmsnorm", "forward")]
    assert rms.status == "no prediction" and "layer_s" in rms.reason and rms.rel_err is None
    s = summary(rec.rows)
    assert s["layer forward"]["measured"] == 2 and len(s["layer forward"]["missing"]) == len(LAYER_KINDS) - 2
    from reports.tables import render

    text = render(out)
    assert "**evaluation**" in text and "| matmul |" in text and "no prediction" in text


def test_evaluate_refuses_a_profile_without_the_element_size(declared, tmp_path):
    p = Profile.load("h200-nvlink")
    p.compute = dataclasses.replace(p.compute, matmul={"2": p.compute.matmul["2"]})
    path = p.save(tmp_path / "bf16only.json")
    with pytest.raises(UserError, match="no matmul figures for 4-byte"):
        compute_main(["evaluate", "--heldout", str(declared), "--profile", str(path), "--out",
                      str(tmp_path / "e.json"), *FAST])


def test_matmul_check_after_timing_finds_a_kernel_that_corrupts_its_second_call():
    good = ce._matmul_arm(torch, "cpu", torch.float32, 16, 24, 8, None)
    planted = ce._matmul_arm(torch, "cpu", torch.float32, 16, 24, 8, None)
    inner, calls = planted.fn, []

    def corrupting(i):
        calls.append(i)
        out = inner(i)
        if len(calls) >= 2:
            out[0, 0] += 1.0
        return out

    planted.fn = corrupting
    res = compare(Solo(), [("good", lambda: good), ("planted", lambda: planted)], timing(4, 1, True, check=True))
    assert res["good"].ok and res["good"].wrong_before == 0 and res["good"].wrong_after == 0
    assert res["planted"].wrong_before == 0 and res["planted"].wrong_after == 1
    assert res["planted"].status is Status.WRONG and res["planted"].median_s is None


def test_sdpa_check_compares_one_head_with_the_reference():
    for backward in (False, True):
        assert ce._sdpa_arm(torch, "cpu", torch.float32, (2, 4, 2, 32, 16), backward, None).check(3) == 0
    arm = ce._sdpa_arm(torch, "cpu", torch.float32, (2, 4, 2, 32, 16), False, None)
    inner = arm.fn
    arm.fn = lambda i: inner(i) * 1.01
    assert arm.check(5) > 0


def test_medians_raise_what_stopped_an_arm():
    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    ok = [("a", lambda: TorchArm(torch, "cpu", lambda i: torch.ones(4).sum()))]
    t = medians(torch, ok, timing(3, 0, back_to_back=False))
    assert set(t) == {"a"} and t["a"] > 0
    with pytest.raises(torch.cuda.OutOfMemoryError):
        medians(torch, [("b", oom)], timing(3, 0, back_to_back=True))
    with pytest.raises(RuntimeError, match="timing c failed"):
        medians(torch, [("c", lambda: 1 / 0)], timing(3, 0, back_to_back=True))
    iso, batches = timing(20, 2, back_to_back=False), timing(20, 2, back_to_back=True)
    assert (iso.rounds, iso.calls) == (20, 1) and (batches.rounds, batches.calls) == (3, 7)


def test_a_row_without_a_figure_says_why():
    rows = [Row("matmul", "a", "forward", 1.0, 2.0, "ok"), Row("matmul", "b", "forward", 1.0, None, "failed", "x"),
            Row("matmul", "c", "forward", 3.0, 4.0, "ok"), Row("matmul", "d", "forward", 5.0, 4.0, "ok")]
    s = summary(rows)["matmul forward"]
    assert s["measured"] == 3 and s["missing"] == ["b: failed (x)"]
    assert s["median_err"] == pytest.approx(-0.25) and s["worst_abs_err"] == pytest.approx(0.5)
    assert s["spearman"] == pytest.approx(3 ** 0.5 / 2)      # ranks (1, 2, 3) against (1, 2.5, 2.5)
