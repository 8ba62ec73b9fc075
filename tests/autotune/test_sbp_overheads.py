"""Nothing priced at zero by default (issue 42): multi-GPU planning refuses a profile without the host's cost of
apply's paths or the overlap slowdown; with them, the compute beside the gradient sync runs slower (closed form)."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from calibrate.errors import UserError
from calibrate.profile import Profile
from models import load_model

from autotune.sbp.boxing import Coster
from autotune.sbp.cost import Problem
from autotune.sbp.mesh import Cluster
from autotune.sbp.steptime import overlapped, require_overheads

MODEL = {"layers": 4, "hidden": 512, "heads": 4, "kv_heads": 2, "ffn": 2048, "vocabulary": 256, "sequence": 256,
         "batch": 8, "micro_batch": 4}
OVERLAP = {"all_reduce": 1.5, "all_gather": 1.2, "reduce_scatter": 1.3, "peer": "nccl"}


def profile(**compute):
    base = Profile.load("h200-nvlink")
    return replace(base, compute=replace(base.compute, **compute))


def problem(p, devices: int = 2):
    return Problem(load_model("llama", None, MODEL), Coster(p, Cluster(1, devices)), None, require_fit=False,
                   objective="step")


@pytest.mark.parametrize("lacks, words", [({"overlap": {}}, "overlap"), ({"host_s": {}}, r"host_s \(dtensor, ddp")])
def test_a_profile_without_the_figures_is_refused_for_several_devices(lacks, words):
    p = profile(**{"overlap": OVERLAP, **lacks})
    with pytest.raises(UserError, match=words) as e:
        require_overheads(p, 2)
    assert "python -m calibrate compute" in str(e.value) and "\n" not in str(e.value)
    require_overheads(p, 1)  # one device: no collectives, no path of several devices
    require_overheads(profile(overlap=OVERLAP), 2)  # with both: planned


def test_the_command_refuses_in_one_line(tmp_path):
    path = tmp_path / "bare.json"
    profile(host_s={}).save(path)
    r = subprocess.run([sys.executable, "-m", "autotune", "--model", "gpt", "--layers", "2", "--nodes", "1", "--gpus-per-node", "2",
                        "--profile", str(path), "--objective", "step", "--compare", "none", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if not x.startswith("[")]
    assert r.returncode == 2 and len(lines) == 1 and "calibrate compute" in lines[0] and "Traceback" not in r.stderr


def test_the_backward_beside_the_sync_runs_slower_in_closed_form():
    """DDP: exposed = max(S - W, F) + (k - 1) (S - that): the backward beside the hidden sync k times slower."""
    plain, slow = problem(profile(overlap={**OVERLAP, "all_reduce": 1.0})), problem(profile(overlap=OVERLAP))
    assign = [int(sync.argmax()) for sync in plain.node_sync]  # weights replicated: data parallel's gradient sync
    S = sum(c * plain.node_sync[v][i] for v, (c, i) in enumerate(zip(plain.counts, assign))) - plain.tied_saved(assign)
    W = sum(c * plain.node_bwd[v][i] for v, (c, i) in enumerate(zip(plain.counts, assign)))
    F = plain.node_sync[plain.first][assign[plain.first]]
    exposed = max(S - W, F)
    assert plain.exposed_sync(assign) == pytest.approx(exposed)
    assert slow.exposed_sync(assign) == pytest.approx(exposed + 0.5 * (S - exposed))
    assert slow.raw_cost(assign) - plain.raw_cost(assign) == pytest.approx(0.5 * (S - exposed))
    assert S > exposed  # some sync is hidden, so the slowdown shows
    # the search's incremental form agrees with the whole
    v = 3
    assert slow._extra(assign, v)[assign[v]] == pytest.approx(slow.exposed_sync(assign))


def test_overlapped_is_max_when_nothing_slows():
    assert overlapped(5.0, 3.0, 1.0, 1.0) == 2.0 and overlapped(5.0, 3.0, 1.0, 2.0) == 5.0
    assert overlapped(1.0, 3.0, 0.5, 2.0) == 1.0  # F = 0.5 < S - W < 0: S - F hidden, 0.5 s beside it twice as slow


def test_overlapped_numbers_and_arrays_agree():
    """The searches price one plan with numbers and a layer's every choice with arrays: one rule either way."""
    import numpy as np
    rng = np.random.default_rng(0)
    S, W, F = (rng.uniform(0, 2, 50) for _ in range(3))
    arrays = overlapped(S, W, F, 1.3)
    assert [overlapped(float(s), float(w), float(f), 1.3) for s, w, f in zip(S, W, F)] == pytest.approx(arrays, abs=0)
    assert overlapped(float(S[0]), W, float(F[0]), 1.3) == pytest.approx(overlapped(S[:1], W, F[:1], 1.3), abs=0)


@pytest.mark.parametrize("bad", [{"all_reduce": 0.1}, {"all_reduce": 1.1, "peer": "ib"}, {"nvls": 1.1}])
def test_a_bad_overlap_is_one_line(bad):
    from calibrate.compute import ComputeModel
    d = Profile.load("h200-nvlink").compute.to_dict()
    d["overlap"] = bad
    with pytest.raises(UserError, match="overlap"):
        ComputeModel.from_dict(d)
