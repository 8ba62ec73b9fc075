"""The calibration harness for real: several MPI ranks on this machine."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from calibrate.sizes import snap

MPIEXEC = Path(sys.executable).with_name("mpiexec")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="the mpich wheel's mpiexec is not installed")


def calibrate(np_, *args, timeout=240):
    cmd = [str(MPIEXEC), "-n", str(np_), sys.executable, "-m", "calibrate", "run", "--backend", "mpi", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


SMALL = ["-b", "1K", "-e", "16K", "--iters", "3", "--reps", "3", "--warmup", "1"]


def test_run_check_resume_and_fit(tmp_path):
    out = tmp_path / "res"
    r = calibrate(4, *SMALL, "--check", "--collectives", "allreduce,alltoall,sendrecv", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "#wrong" in r.stdout
    stats = pd.read_csv(out / "stats.csv")
    assert len(stats) == 3 * 5 and (stats["wrong"] == 0).all()
    samples = pd.read_csv(out / "samples.csv")
    assert len(samples) == 3 * 5 * 3
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["world_size"] == 4 and len(meta["ranks"]) == 4
    # resume measures only what is missing: drop two rows as a kill would have
    lines = (out / "stats.csv").read_text().splitlines(keepends=True)
    (out / "stats.csv").write_text("".join(lines[:-2]) + lines[-2][:10])  # torn last line
    r = calibrate(4, *SMALL, "--check", "--collectives", "allreduce,alltoall,sendrecv", "--out", str(out), "--resume")
    assert r.returncode == 0, r.stderr
    again = pd.read_csv(out / "stats.csv")
    assert len(again) == 15 and again[["collective", "bytes"]].duplicated().sum() == 0
    # a different configuration cannot resume the same directory
    r = calibrate(4, *SMALL, "--mode", "isolated", "--out", str(out), "--resume")
    assert r.returncode == 2 and "mode" in r.stderr and "Traceback" not in r.stderr
    # without --resume an existing directory is refused
    r = calibrate(4, *SMALL, "--out", str(out))
    assert r.returncode == 2 and "--resume" in r.stderr
    fit = subprocess.run([sys.executable, "-m", "calibrate", "fit", str(out), "-o", str(tmp_path / "p.json")],
                         capture_output=True, text=True, timeout=120)
    assert fit.returncode == 0, fit.stderr
    assert "heldout_median_%" in fit.stdout
    rep = subprocess.run([sys.executable, "-m", "reports", str(out), str(tmp_path / "p.json"), "-o",
                          str(tmp_path / "r.html")], capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    html = (tmp_path / "r.html").read_text()
    assert html.count("<svg") >= 3 and "Calibration" in html


@pytest.mark.parametrize("args, message", [
    (["--collectives", "allreduse"], "unknown collective"),
    (["-b", "1M", "-e", "1K"], "swap"),
    (["-b", "0"], "positive"),
    (["--mode", "graph"], "graph timing needs GPUs"),
    (["--backend", "gloo"], "unknown backend"),
    (["--out", "/proc/forbidden"], "cannot write"),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    r = calibrate(2, *SMALL, "--out", str(tmp_path / "x"), *args)
    assert r.returncode == 2
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in r.stderr


def test_isolated_mode_and_uneven_size_note(tmp_path):
    r = calibrate(3, "-b", "1000", "-e", "1000", "--iters", "4", "--mode", "isolated", "--check",
                  "--collectives", "allgather", "--out", str(tmp_path / "iso"))
    assert r.returncode == 0, r.stderr
    assert "rounded to 996 B" in r.stderr
    st = pd.read_csv(tmp_path / "iso" / "stats.csv")
    assert st["bytes"].tolist() == [996] and st["n"].tolist() == [4]


def test_nccl_backend_without_gpu_is_a_clear_error(tmp_path):
    r = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "calibrate", "run", "--backend", "nccl",
                        *SMALL, "--out", str(tmp_path / "n")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "error:" in r.stderr and ("cupy" in r.stderr or "no GPU" in r.stderr) and "Traceback" not in r.stderr


def test_refine_resume_random_validation_and_fit(tmp_path):
    """--refine adds sizes after the sweep (phase refine in points.csv); --random measures sizes off the grid
    in turn with the sweep's, into a directory of their own; a resumed run measures nothing again;
    validate --random measures sizes on its own, and fit --validation records their errors."""
    out, rand, prof = tmp_path / "res", tmp_path / "rand", tmp_path / "p.json"
    args = ["-b", "1K", "-e", "256K", *SMALL[4:], "--collectives", "allreduce,sendrecv", "--refine",
            "--refine-budget", "2", "--refine-tol", "0.0", "--check", "--random", "4", "--random-seed", "3",
            "--size-unit", "256", "--out", str(out)]
    r = calibrate(2, *args)
    assert r.returncode == 0, r.stderr
    assert re.search(r"refined points \(\d+ probes inside the intervals; limit (6[4-9]|[7-9]\d|\d{3,})\)", r.stderr) \
        and "budget 200%" in r.stderr
    points = pd.read_csv(out / "points.csv")
    sweep_rows = points[points["phase"] == "sweep"]
    assert len(sweep_rows) == 2 * 9 and (points["wall_s"] > 0).all()
    assert set(points["phase"]) <= {"sweep", "refine"}
    assert ((points["bytes"] // 512) % 2 == 1).all() and (points["bytes"] % 512 == 0).all()  # --size-unit 256
    beside = tmp_path / "res-random"
    drawn = pd.read_csv(beside / "points.csv")
    assert set(drawn["phase"]) == {"random"} and len(drawn) == 8
    assert not set(drawn["bytes"]) & set(sweep_rows["bytes"]) and all(snap(int(n)) != n for n in drawn["bytes"])
    st = pd.read_csv(beside / "stats.csv")
    assert (st["wrong"] == 0).all()  # checked like the sweep's sizes
    meta = json.loads((beside / "meta.json").read_text())
    assert meta["config"]["phase"] == "random" and meta["config"]["min_batch_s"] == 0.001
    assert all(r["cores"] for r in meta["ranks"])
    refine = json.loads((out / "refine.json").read_text())
    assert set(refine) == {"world:2x1/allreduce", "world:2x1/sendrecv"}
    assert all(v["refined_points"] == (points["phase"] == "refine").groupby(points["collective"]).sum()
               .get(k.split("/")[1], 0) for k, v in refine.items())
    before = [(d / "stats.csv").read_text() for d in (out, beside)]
    r = calibrate(2, *args, "--resume")
    assert r.returncode == 0, r.stderr
    assert [(d / "stats.csv").read_text() for d in (out, beside)] == before  # replayed from disk
    fit = subprocess.run([sys.executable, "-m", "calibrate", "fit", str(out), "-o", str(prof), "--quiet",
                          "--validation", str(beside)], capture_output=True, text=True, timeout=120)
    assert fit.returncode == 0, fit.stderr
    assert "max_abs_err_pct" in fit.stdout
    offline = subprocess.run([sys.executable, str(ROOT / "tests/gpu/calib_offline.py"), str(out), str(beside)],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert offline.returncode == 0, offline.stderr
    assert {"interpolate", "segments"} <= set(offline.stdout.split()) and "measured around" in offline.stdout
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "calibrate", "validate", "--profile", str(prof),
           "--random", "5", "--seed", "4", "-e", "256K", "--backend", "mpi", "--iters", "3", "--reps", "3",
           "--warmup", "1", "--collectives", "allreduce,sendrecv", "--out", str(rand)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stderr
    assert "predicted_us" in r.stdout and "max_abs_err_pct" in r.stdout
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.split()[-1:] and ln.split()[-1].endswith("/10")]
    assert [row[-1] for row in rows] == [f"{i}/10" for i in range(1, 11)]   # each row: its collective, its place
    assert [row[-2] for row in rows] == ["allreduce", "sendrecv"] * 5
    st = pd.read_csv(rand / "stats.csv")
    assert len(st) == 10 and (st["bytes"] % 512 == 0).all()
    assert not set(st["bytes"]) & set(sweep_rows["bytes"])
    assert all(snap(int(n)) != n for n in st["bytes"])  # none on the 4-significant-bit grid
    fit = subprocess.run([sys.executable, "-m", "calibrate", "fit", str(out), "-o", str(prof), "--quiet",
                          "--validation", str(rand), "--note", "CPU test"], capture_output=True, text=True, timeout=120)
    assert fit.returncode == 0, fit.stderr
    saved = json.loads(prof.read_text())
    assert saved["version"] == 2 and saved["provenance"]["note"] == "CPU test"
    rows = saved["provenance"]["random_validation"]["summary"]
    assert {r["collective"] for r in rows} == {"allreduce", "sendrecv"} and all(r["points"] == 5 for r in rows)


def test_pairs_beside_the_world_give_a_fit_per_group_size(tmp_path):
    """Issue 45: groups of 2 inside a node of 4 measured beside the world group; the profile holds the fits
    of p = 2 and p = 4 on the intra tier and prices a group of 2 from the pairs' own measurements."""
    from calibrate.collectives import Collective
    from calibrate.profile import Group, Profile

    out = tmp_path / "res"
    r = calibrate(4, *SMALL, "--groups", "world,pairs", "--collectives", "allreduce", "--out", str(out))
    assert r.returncode == 0, r.stderr
    stats = pd.read_csv(out / "stats.csv")
    assert sorted(stats["group"].unique()) == ["pairs:2x1", "world:4x1"]
    fit = subprocess.run([sys.executable, "-m", "calibrate", "fit", str(out), "-o", str(tmp_path / "p.json")],
                         capture_output=True, text=True, timeout=120)
    assert fit.returncode == 0, fit.stderr
    prof = Profile.load(tmp_path / "p.json")
    assert sorted(prof.tiers["intra"]["allreduce"]) == ["2", "4"]
    pairs = stats[stats["group"] == "pairs:2x1"]
    model, p = prof.model(Collective.ALLREDUCE, Group(2))
    assert p == 2 and model is prof.tiers["intra"]["allreduce"]["2"]
    assert model.points == [[float(b), pytest.approx(t)] for b, t in zip(pairs["bytes"], pairs["median_s"])]
    assert prof.model(Collective.ALLREDUCE, Group(4))[0] is prof.tiers["intra"]["allreduce"]["4"]
    # an odd number of ranks per node cannot form pairs: one line
    r = calibrate(3, *SMALL, "--groups", "world,pairs", "--collectives", "allreduce", "--out", str(tmp_path / "odd"))
    assert r.returncode == 2 and "even number of ranks" in r.stderr and "Traceback" not in r.stderr
