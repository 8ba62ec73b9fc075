"""The host's cost per apply path (``autotune.execute.hostfit``): the least-squares fit recovers the
coefficients of host issue times made from them (closed form), drops a negative per-step share, refuses runs
that cannot separate the per-pass cost; ``execute --fit-host`` writes them into a profile that loads back;
a profile's host figures are validated."""
import json
from dataclasses import replace

import pytest

from autotune.__main__ import main as autotune_main
from autotune.execute.hostfit import HostPoint, fit
from autotune.execute.result import KIND, VERSION, write_record
from autotune.plan.typed import ModelSpec
from calibrate.errors import UserError
from calibrate.profile import Profile

MODEL = dict(kind="llama", hidden=64, heads=4, kv_heads=2, ffn=128, sequence=16, vocabulary=256, batch=8)
FIXED, PASS, STEP = 3e-3, 400e-6, 40e-6


def occurrences(layers: int) -> int:
    cfg = dict(MODEL, layers=layers, micro_batch=8)
    return len(ModelSpec(cfg.pop("kind"), cfg).graph().chain)


def points(path="ddp", fixed=FIXED, per_pass=PASS, per_step=STEP, family=("llama",)):
    return [HostPoint(path, occurrences(L), m, fixed + occurrences(L) * (m * per_pass + per_step), "H100", family)
            for L in (2, 8) for m in (1, 4)]


def test_fit_recovers_the_coefficients():
    f = fit(points())
    assert f.per_pass_s == pytest.approx(PASS, rel=1e-9) and f.per_step_s == pytest.approx(STEP, rel=1e-9)
    assert f.fixed_s == pytest.approx(FIXED, rel=1e-9) and f.worst == pytest.approx(0, abs=1e-9)


def test_a_negative_per_step_share_is_noise_and_dropped():
    f = fit(points(per_step=-5e-6))
    assert f.per_step_s == 0 and f.per_pass_s > 0 and f.fixed_s >= 0


def test_runs_that_cannot_separate_the_pass_are_refused():
    one_depth = [p for p in points() if p.occurrences == occurrences(2)]
    with pytest.raises(UserError, match="two depths and two micro-batch counts"):
        fit(one_depth)
    mixed = points()[:2] + points(family=("gpt",))[2:]
    with pytest.raises(UserError, match="several models"):
        fit(mixed)
    with pytest.raises(UserError, match="does not grow"):
        fit(points(per_pass=0.0, per_step=0.0))


def _record(path: str, layers: int, m: int, host: float) -> dict:
    return {"kind": KIND, "version": VERSION, "strategy": f"{path} L{layers} m{m}", "apply_path": path,
            "model": dict(MODEL, layers=layers, micro_batch=MODEL["batch"] // m), "cluster": {"nodes": 1, "gpus_per_node": 2},
            "device": "NVIDIA H100", "backend": "nccl", "dtype": "bfloat16", "micro_batches": m,
            "measured": {"step_s": host, "losses": [1.0], "host_issue_s": host}}


def test_fit_host_writes_a_profile_that_loads(tmp_path, capsys):
    dirs = []
    for path, per_pass in (("ddp", PASS), ("dtensor", 6 * PASS)):
        for L in (2, 8):
            for m in (1, 4):
                d = tmp_path / f"{path}-{L}-{m}"
                write_record(d, 0, _record(path, L, m, FIXED + occurrences(L) * (m * per_pass + STEP)))
                dirs.append(str(d))
    out = tmp_path / "p.json"
    assert autotune_main(["execute", "--fit-host", *dirs, "--profile", "h200-nvlink", "--profile-out", str(out)]) == 0
    assert "dtensor" in capsys.readouterr().out
    host = Profile.load(out).compute.host_s
    assert host["ddp"] == pytest.approx((PASS, STEP), rel=1e-6)
    assert host["dtensor"] == pytest.approx((6 * PASS, STEP), rel=1e-6)
    assert host["fully_shard"] == Profile.load("h200-nvlink").compute.host_s["fully_shard"]  # not fitted: kept
    cm = Profile.load(out).compute
    assert cm.host_seconds("ddp", 10) == pytest.approx((10 * PASS, 10 * STEP))
    assert cm.host_seconds("sequence", 10) == pytest.approx(tuple(10 * x for x in host["sequence"]))  # kept
    bare = replace(cm, host_s={k: v for k, v in cm.host_s.items() if k != "sequence"})
    assert bare.host_seconds("sequence", 10) == bare.host_seconds("tensor", 10)  # its stand-in where it lacks one


@pytest.mark.parametrize("bad", [{"nccl": [1e-4, 0]}, {"ddp": [1e-4]}, {"ddp": [-1e-4, 0]}, {"ddp": [2.0, 0]},
                                 {"ddp": ["x", 0]}, [1, 2]])
@pytest.mark.parametrize("key", ["host_s", "host_outside_s"])
def test_bad_host_figures_are_one_line(bad, key, tmp_path):
    d = json.loads(json.dumps(Profile.load("h200-nvlink").to_dict()))
    d["compute"][key] = bad
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match=key):
        Profile.load(tmp_path / "p.json")


def test_fit_host_needs_both_profiles(tmp_path, capsys):
    assert autotune_main(["execute", "--fit-host", str(tmp_path), "--profile", "h200-nvlink"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--profile-out" in err[0]


def test_figures_outside_the_blocks_round_trip(tmp_path):
    from dataclasses import replace
    p = Profile.load("h200-nvlink")
    whole = {"tensor": (0.03, 0.004), "sequence": (0.035, 0.004)}
    replace(p, compute=replace(p.compute, host_outside_s=whole)).save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").compute.host_outside_s == whole
