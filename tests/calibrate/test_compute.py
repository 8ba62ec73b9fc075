"""The compute model: closed forms on datasheet bands and interpolation on measured points."""
import dataclasses
import json
import math

import pytest

from calibrate.compute import Band, ComputeModel
from calibrate.errors import UserError
from calibrate.profile import Profile, embedded_profile_names


def model(points=()):
    d = {"kind": "measured", "source": "test", "launch_s": 1e-5, "memory_Bps": 1e12,
         "matmul": {"2": {"peak_flops": 1e15, "points": [list(p) for p in points]}}}
    return ComputeModel.from_dict(d)


def test_peak_band_closed_form():
    m = model()
    assert m.matmul_seconds(1000, 2000, 3000, 2) == pytest.approx(1e-5 + 2 * 1000 * 2000 * 3000 / 1e15)
    assert m.memory_seconds(2e9) == pytest.approx(1e-5 + 2e-3)
    # attention without its own band falls back to the matmul band: 4 b h s^2 d flops
    assert m.attention_seconds(2, 4, 128, 64, 2) == pytest.approx(1e-5 + 4 * 2 * 4 * 128 * 128 * 64 / 1e15)


def test_points_interpolate_log_log_and_extrapolate_at_constant_rate():
    m = model([(1e9, 1e-5), (1e12, 2e-3)])
    band = m.matmul["2"]
    # halfway on a log scale between the points: the geometric mean of the times
    assert band.seconds(math.sqrt(1e9 * 1e12), 1e-5) == pytest.approx(math.sqrt(1e-5 * 2e-3))
    assert band.seconds(4e12, 1e-5) == pytest.approx(8e-3)  # the last point's throughput
    assert band.seconds(1e6, 1e-5) == pytest.approx(1e-5)  # never below a launch


def test_attention_on_the_scores_axis_ignores_the_head_dimension():
    """Points measured at b = 4, h = 16 (b h = 64) for s = 1024 and 2048: b h = 128 at s = 1024 has
    twice the score elements of the first point, half those of the second (geometric mean of their
    times, log-log), whatever d; on the flops axis the same points would give the second point's time."""
    t1, t2 = 5.8e-4, 2.3e-3
    d = {"kind": "measured", "source": "test", "launch_s": 1e-5, "memory_Bps": 1e12,
         "matmul": {"2": {"peak_flops": 1e15}},
         "attention": {"2": {"peak_flops": 1e15, "axis": "scores",
                             "points": [[64 * 1024**2, t1], [64 * 2048**2, t2]]}}}
    m = ComputeModel.from_dict(d)
    want = math.sqrt(t1 * t2)
    assert m.attention_seconds(4, 32, 1024, 128, 2) == pytest.approx(want)
    assert m.attention_seconds(4, 32, 1024, 64, 2) == pytest.approx(want)
    assert m.attention_seconds(8, 16, 1024, 128, 2) == pytest.approx(want)
    assert ComputeModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert m.attention_seconds(4, 32, 1024, 128, 2, backward=True) == pytest.approx(2 * want)  # none measured: 2x
    d["attention_backward"] = {"2": {"peak_flops": 1e15, "axis": "scores", "points": [[64 * 1024**2, 3 * t1]]}}
    m = ComputeModel.from_dict(d)
    assert m.attention_seconds(4, 16, 1024, 128, 2, backward=True) == pytest.approx(3 * t1)
    assert ComputeModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    d["attention"]["2"]["axis"] = "tokens"
    with pytest.raises(UserError, match="axis"):
        ComputeModel.from_dict(d)


def test_attention_copies_on_the_elements_axis():
    """The layer around the core, measured per output element b s h d: b = 4, h = 16, s = 1024,
    d = 128 (8 Mi elements) and twice that; b = 8, h = 32, s = 1024, d = 128 has 4x the first
    point's elements: above the last point, its throughput (time x 2). None when not measured."""
    d = {"kind": "measured", "source": "test", "launch_s": 1e-5, "memory_Bps": 1e12,
         "matmul": {"2": {"peak_flops": 1e15}},
         "attention_copies": {"2": {"peak_flops": 1e15, "axis": "elements",
                                    "points": [[4 * 16 * 1024 * 128, 1e-4], [8 * 16 * 1024 * 128, 2.2e-4]]}},
         "attention_copies_backward": {"2": {"peak_flops": 1e15, "axis": "elements",
                                             "points": [[4 * 16 * 1024 * 128, 3e-4]]}}}
    m = ComputeModel.from_dict(d)
    assert m.attention_copy_seconds(4, 16, 1024, 128, 2) == pytest.approx(1e-4)
    assert m.attention_copy_seconds(8, 32, 1024, 128, 2) == pytest.approx(2 * 2.2e-4)
    assert m.attention_copy_seconds(4, 16, 1024, 128, 2, backward=True) == pytest.approx(3e-4)
    assert m.attention_copy_seconds(4, 16, 1024, 128, 4) is None
    assert model().attention_copy_seconds(4, 16, 1024, 128, 2) is None
    assert ComputeModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_memory_bound_kinds_fall_back_in_order():
    """op_seconds: a kind's own bandwidth, else the kind it falls back to (embedding -> elementwise
    -> the copy's memory_Bps); a bad kind or value in a profile is one error line."""
    d = {"kind": "measured", "source": "test", "launch_s": 1e-6, "memory_Bps": 4e12,
         "matmul": {"2": {"peak_flops": 1e15}}}
    assert ComputeModel.from_dict(d).op_seconds("embedding_backward", 4e9) == pytest.approx(1e-6 + 1e-3)
    d["op_Bps"] = {"elementwise": 2e12}
    m = ComputeModel.from_dict(d)
    assert m.op_seconds("embedding", 4e9) == pytest.approx(1e-6 + 2e-3)
    assert m.op_seconds("optimizer", 4e9) == pytest.approx(1e-6 + 2e-3)
    d["op_Bps"] = {"elementwise": 2e12, "embedding_backward": 5e11}
    m = ComputeModel.from_dict(d)
    assert m.op_seconds("embedding_backward", 4e9) == pytest.approx(1e-6 + 8e-3)
    assert m.op_seconds("embedding", 4e9) == pytest.approx(1e-6 + 2e-3)
    assert m.op_seconds("elementwise", 0) == 0.0
    assert ComputeModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    for bad in ({"gelu": 1e12}, {"optimizer": 0}, {"optimizer": "fast"}, [1e12]):
        d["op_Bps"] = bad
        with pytest.raises(UserError, match="op_Bps"):
            ComputeModel.from_dict(d)


def test_missing_dtype_names_the_fix():
    with pytest.raises(UserError, match="calibrate compute --dtypes fp32"):
        model().matmul_seconds(10, 10, 10, 4)


def test_bad_section_is_one_line_error():
    with pytest.raises(UserError, match="peak_flops"):
        ComputeModel.from_dict({"kind": "measured", "launch_s": 0, "memory_Bps": 1, "matmul": {"2": {}}})


def test_embedded_gpu_profiles_carry_compute_with_sources(tmp_path):
    for name in embedded_profile_names():
        p = Profile.load(name)
        if p.hardware.get("gpu") is None:
            continue
        assert p.compute is not None, name
        assert p.compute.sources.get("matmul.2") and p.compute.source
        assert p.compute.matmul_seconds(4096, 4096, 4096, 2) > 0
    p = Profile.load("gcp-a100")
    back = Profile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back.compute == p.compute
    assert back.compute.matmul["2"] == Band(312e12)



def test_merge_copies_only_the_compute_and_device_sections(tmp_path):
    from importlib import resources

    from calibrate.__main__ import main
    src, dst = tmp_path / "measured.json", tmp_path / "embedded.json"
    p = Profile.load("h200-nvlink")
    p.compute = model([(1e9, 1e-5), (1e12, 2e-3)])
    p.save(src)
    before = json.loads(resources.files("calibrate.profiles").joinpath("gcp-a100.json").read_text())
    dst.write_text(json.dumps(before, indent=1))
    assert main(["compute", "--merge", str(src), "--out", str(dst)]) == 0
    after = json.loads(dst.read_text())
    assert after["compute"] == p.compute.to_dict() and after["device"] == p.device.to_dict()
    assert before["device"] != p.device.to_dict()
    rest = ("compute", "device")
    assert {k: v for k, v in after.items() if k not in rest} == {k: v for k, v in before.items() if k not in rest}


def sdpa_model(points, gqa="enable_gqa"):
    """A model with the given SDPA points, each (batch, heads, kv_heads, sequence, head_dim, fwd, bwd)."""
    keys = ("batch", "heads", "kv_heads", "sequence", "head_dim", "forward_s", "backward_s")
    d = {"kind": "measured", "source": "test", "launch_s": 1e-6, "memory_Bps": 1e12,
         "matmul": {"2": {"peak_flops": 1e15}},
         "sdpa": {"2": {"gqa": gqa, "causal": True,
                        "points": [dict(zip(keys, p), backend="flash") for p in points]}}}
    return d


def test_sdpa_interpolates_per_head_along_the_sequence_and_scales_by_flops():
    """Time per (batch x head) interpolated log-log in the sequence; batch, heads and head_dim scale
    linearly (flops); beyond the measured sequences (s / s_end)^2."""
    d = sdpa_model([(32, 8, 8, 512, 64, 1e-4, 3e-4), (8, 8, 8, 2048, 64, 1.6e-3, 4e-3),
                    (32, 8, 8, 512, 128, 2e-4, 5e-4)])
    m = ComputeModel.from_dict(d)
    assert m.sdpa_seconds(32, 8, 8, 512, 64, 2) == pytest.approx(1e-4)  # a grid point, exactly
    assert m.sdpa_seconds(8, 8, 8, 2048, 64, 2, backward=True) == pytest.approx(4e-3)
    u0, u1 = 1e-4 / 256, 1.6e-3 / 64  # per (batch x head)
    assert m.sdpa_seconds(1, 1, 1, 1024, 64, 2) == pytest.approx(math.sqrt(u0 * u1))  # log-midpoint
    assert m.sdpa_seconds(3, 16, 16, 1024, 64, 2) == pytest.approx(48 * math.sqrt(u0 * u1))
    assert m.sdpa_seconds(1, 1, 1, 8192, 64, 2) == pytest.approx(u1 * 16)  # (8192 / 2048)^2
    assert m.sdpa_seconds(32, 8, 8, 256, 128, 2) == pytest.approx(2e-4 / 4)  # below: (256 / 512)^2
    # head_dim 96 is nearer 128 than 64 on a log scale: the d = 128 row, scaled by 96 / 128
    assert m.sdpa_seconds(32, 8, 8, 512, 96, 2, backward=True) == pytest.approx(5e-4 * 96 / 128)
    assert m.sdpa_seconds(1, 1, 1, 16, 64, 2) == pytest.approx(1e-6)  # never below a launch
    assert ComputeModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_sdpa_picks_the_nearest_group_size():
    """(h, kv) rows 8/8 (group 1) and 32/4 (group 8): a query of group 4 reads the 32/4 row (log 4 is
    0.69 from log 8, 1.39 from log 1), scaled to its 16 heads; group 2 reads the 8/8 row."""
    d = sdpa_model([(4, 8, 8, 1024, 128, 1e-3, 2e-3), (4, 32, 4, 1024, 128, 2e-3, 5e-3)])
    m = ComputeModel.from_dict(d)
    assert m.sdpa_seconds(4, 16, 4, 1024, 128, 2) == pytest.approx(2e-3 / 2)
    assert m.sdpa_seconds(4, 16, 16, 1024, 128, 2) == pytest.approx(1e-3 * 2)
    assert m.sdpa_seconds(4, 16, 8, 1024, 128, 2, backward=True) == pytest.approx(2e-3 * 2)  # group 2: nearer 1


def test_sdpa_without_figures_is_the_flash_flop_count_at_the_matmul_rate():
    m = model()
    fwd = 2 * 4 * 16 * 2048**2 * 128
    assert m.sdpa_seconds(4, 16, 4, 2048, 128, 2) == pytest.approx(1e-5 + fwd / 1e15)
    assert m.sdpa_seconds(4, 16, 4, 2048, 128, 2, backward=True) == pytest.approx(1e-5 + 2.5 * fwd / 1e15)
    m = ComputeModel.from_dict(sdpa_model([(4, 8, 8, 1024, 128, 1e-3, 2e-3)]))
    with pytest.raises(UserError, match="--dtypes fp32"):  # no fp32 SDPA nor matmul figures
        m.sdpa_seconds(4, 8, 8, 1024, 128, 4)


@pytest.mark.parametrize("field,value,match", [
    ("forward_s", float("nan"), "bad point"), ("backward_s", 0, "bad point"), ("forward_s", -1e-3, "bad point"),
    ("backend", "triton", "bad point"), ("kv_heads", 3, "bad point"), ("sequence", 1.5, "bad point"),
    ("heads", True, "bad point"), ("sequence", 256, "increasing sequence"), ("sequence", 1024, "increasing sequence")])
def test_bad_sdpa_figures_are_one_line_errors(field, value, match):
    d = sdpa_model([(4, 8, 8, 1024, 128, 1e-3, 2e-3), (2, 8, 8, 2048, 128, 4e-3, 9e-3)])
    d["sdpa"]["2"]["points"][1][field] = value
    with pytest.raises(UserError, match=match) as e:
        ComputeModel.from_dict(d)
    assert "\n" not in str(e.value) and "calibrate compute" in str(e.value)


def test_bad_sdpa_sections_are_refused():
    for bad in ({"2": {"points": []}}, {"2": []}, [1], {"2": {"gqa": "shared", "points": [{}]}},
                {"2": {"causal": False, "points": [{}]}}):
        d = sdpa_model([(4, 8, 8, 1024, 128, 1e-3, 2e-3)])
        d["sdpa"] = bad
        with pytest.raises(UserError, match="sdpa"):
            ComputeModel.from_dict(d)


def test_profiles_without_sdpa_or_device_still_load_and_say_none(tmp_path):
    p = Profile.load("h200-nvlink")
    data = p.to_dict()
    data.pop("device", None)
    data["compute"].pop("sdpa", None)
    old = Profile.from_dict(json.loads(json.dumps(data)))
    assert old.memory_bytes is None and old.compute.sdpa == {}
    assert old.compute.sdpa_seconds(1, 8, 8, 1024, 64, 2) > 0  # the flop-count fallback


def test_device_section_round_trips_and_is_validated():
    p = Profile.load("h200-nvlink")
    data = p.to_dict()
    data["device"] = {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 85_520_809_984,
                      "usable_bytes": 84_500_000_000, "source": "test"}
    q = Profile.from_dict(json.loads(json.dumps(data)))
    assert q.memory_bytes == int(84_500_000_000 * (1 - q.fragmentation_fraction)) and q.device.name == "NVIDIA H100 80GB HBM3"
    assert Profile.from_dict(q.to_dict()).device == q.device
    for bad in ({**data["device"], "usable_bytes": 10**12}, {**data["device"], "total_bytes": 8.5e10},
                {**data["device"], "name": ""}, {k: v for k, v in data["device"].items() if k != "source"},
                {**data["device"], "usable_bytes": -1}, "H100"):
        with pytest.raises(UserError, match="device") as e:
            Profile.from_dict({**data, "device": bad})
        assert "\n" not in str(e.value)


def test_embedded_profiles_name_their_gpu_memory():
    """Every embedded profile with a GPU states its usable memory per device with a source; the
    H200's is nvidia-smi's 143771 MiB less the stated context reserve."""
    for name in embedded_profile_names():
        p = Profile.load(name)
        assert p.device is not None and p.device.source, name
        assert 0 < p.memory_bytes < p.device.total_bytes
    h200 = Profile.load("h200-nvlink")
    assert h200.device.total_bytes == 143771 * 2**20
    assert Profile.load("gcp-a100").device.total_bytes < 41 * 2**30 < h200.memory_bytes
    assert Profile.load("piz-daint").memory_bytes < 16 * 2**30


def test_sdpa_backend_from_op_and_kernel_names():
    from calibrate.cli.compute import sdpa_backend
    assert sdpa_backend(["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
                         "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>"]) == "flash"
    assert sdpa_backend(["aten::_scaled_dot_product_efficient_attention", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) \
        == "efficient"
    assert sdpa_backend(["aten::_scaled_dot_product_cudnn_attention",
                         "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3"]) == "cudnn"
    assert sdpa_backend(["aten::_scaled_dot_product_attention_math", "aten::bmm", "aten::_softmax"]) == "math"
    assert sdpa_backend(["aten::bmm", "aten::_softmax"]) == "math"


def test_sdpa_backend_read_from_the_profiler_on_cpu():
    """On CPUs torch runs its flash-style CPU kernel (aten::_scaled_dot_product_flash_attention_for_cpu)
    unless only the math backend is allowed: the profiler tells the two apart, GQA included."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from calibrate.cli.compute import which_backend
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 4, 16, 8)
    assert which_backend(torch, q, k, v, grad) == "flash"
    with sdpa_kernel([SDPBackend.MATH]):
        assert which_backend(torch, q, k, v, grad) == "math"


def test_sdpa_timing_backward_writes_fresh_gradients():
    """Each timed backward starts from no gradient (a second call gives the first call's gradient,
    not twice it), as in a step where Q, K and V's gradients flow on to the QKV projection."""
    torch = pytest.importorskip("torch")
    from calibrate.cli.compute import fresh_backward
    q = torch.randn(1, 4, 8, 4, requires_grad=True)
    k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, 4, 8, 4)
    fresh_backward(torch, (q, k, v), grad)
    first = [t.grad.clone() for t in (q, k, v)]
    fresh_backward(torch, (q, k, v), grad)
    assert all(torch.equal(a, t.grad) for a, t in zip(first, (q, k, v)))


def test_layer_piece_fit_is_the_line_through_its_sizes():
    from calibrate.compute import fit_layer_piece
    call, per = fit_layer_piece([(4e6, 12e-6 + 4e6 * 3e-12), (6.4e7, 12e-6 + 6.4e7 * 3e-12)])
    assert call == pytest.approx(12e-6) and per == pytest.approx(3e-12)
    # a small size faster than the large one's rate is noise: no negative per-call cost, the rate through 0
    call, per = fit_layer_piece([(1.0, 1.0), (3.0, 9.0)])
    assert call == 0.0 and per == pytest.approx((1 * 1 + 3 * 9) / (1 + 9))
    with pytest.raises(ValueError):
        fit_layer_piece([(4e6, 1e-5)])


def test_layer_seconds_add_the_per_call_cost_and_round_trip():
    d = {"kind": "measured", "source": "test", "launch_s": 1e-6, "memory_Bps": 1e12,
         "matmul": {"2": {"peak_flops": 1e15}}, "layer_s": {"rmsnorm": [1e-11, 3e-11], "gelu": [2e-12, 4e-12]},
         "layer_call_s": {"rmsnorm": [5e-6, 9e-6]}}
    m = ComputeModel.from_dict(d)
    assert m.layer_seconds("rmsnorm", 1e6) == pytest.approx((5e-6 + 1e-5, 9e-6 + 3e-5))
    assert m.layer_seconds("gelu", 1e6) == pytest.approx((2e-6, 4e-6))  # no per-call figure: the rate alone
    assert m.layer_seconds("rmsnorm", 0) == (0.0, 0.0) and m.layer_seconds("swiglu", 1e6) is None
    assert ComputeModel.from_dict(json.loads(json.dumps(m.to_dict()))).layer_call_s == m.layer_call_s
    with pytest.raises(UserError, match="layer_call_s for swiglu without its layer_s"):
        ComputeModel.from_dict(dict(d, layer_call_s={"swiglu": [1e-6, 1e-6]}))
    with pytest.raises(UserError, match="bad layer_call_s"):
        ComputeModel.from_dict(dict(d, layer_call_s={"rmsnorm": [float("nan"), 1e-6]}))


def test_context_core_ratio_interpolates_in_log_sequence_on_the_nearest_c():
    """``context_core``: c = 2 measured at 8192 (2.0) and 32768 (1.2), c = 8 at 32768 (1.5): c = 2 at 16384 is the
    log-midpoint's mean (1.6); beyond the points the nearest one's; c = 3 reads c = 2 (nearer on a log scale than 8),
    c = 4 on a log tie reads 8 (the larger); none measured: 1, the ideal split; bad figures are one line."""
    d = {"kind": "measured", "source": "test", "launch_s": 1e-5, "memory_Bps": 1e12,
         "matmul": {"2": {"peak_flops": 1e15}},
         "context_core": {"2": [[2, 8192, 2.0], [2, 32768, 1.2], [8, 32768, 1.5]]}}
    m = ComputeModel.from_dict(d)
    assert m.context_core_ratio(2, 16384, 2) == pytest.approx(1.6)
    assert m.context_core_ratio(2, 4096, 2) == 2.0 and m.context_core_ratio(2, 65536, 2) == 1.2
    assert m.context_core_ratio(3, 32768, 2) == 1.2 and m.context_core_ratio(4, 32768, 2) == 1.5
    assert m.context_core_ratio(2, 32768, 4) == 1.0
    assert ComputeModel.from_dict(json.loads(json.dumps(m.to_dict()))).context_core == m.context_core
    for bad in ({"2": [[1, 8192, 1.5]]}, {"2": [[2, 8192, 0.1]]}, {"2": [[2, 8192]]}, {"2": "x"}):
        with pytest.raises(UserError, match="context_core"):
            ComputeModel.from_dict(dict(d, context_core=bad))


def test_merge_of_named_sections_keeps_the_rest(tmp_path):
    """``--merge --sections sdpa``: the measured profile's SDPA grid and its sources come in, every other part of
    --out's compute section (its matmuls, its host figures) and its device section stay; a part the measured
    profile lacks, or --sections without --merge, is one line naming the fix."""
    from calibrate.__main__ import main
    from calibrate.cli.compute import main as compute_main
    src, dst = tmp_path / "measured.json", tmp_path / "embedded.json"
    p = Profile.load("h100-nvlink+ib400")
    p.save(src)
    before = Profile.load("h200-nvlink+ib400")
    before.compute = dataclasses.replace(before.compute, sdpa={})
    before.save(dst)
    assert main(["compute", "--merge", str(src), "--out", str(dst), "--sections", "sdpa"]) == 0
    after = Profile.load(str(dst))
    assert after.compute.sdpa == p.compute.sdpa and after.compute.matmul == before.compute.matmul
    assert after.compute.host_s == before.compute.host_s and after.device == before.device
    assert after.compute.sources["sdpa.2"] == p.compute.sources["sdpa.2"]
    assert after.compute.sources["matmul.2"] == before.compute.sources["matmul.2"]
    src_h200 = tmp_path / "h200.json"
    before.save(src_h200)
    for argv, match in ((["--merge", str(src_h200), "--sections", "sdpa"], "has no sdpa to merge"),
                        (["--sections", "sdpa"], "--sections picks parts of a --merge")):
        with pytest.raises(UserError, match=match) as e:
            compute_main(["--out", str(dst), *argv])
        assert "\n" not in str(e.value)
