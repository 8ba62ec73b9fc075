"""Faults while writing: a kill -9 in mid-run, a full disk, two writers. Nothing measured may be
lost or duplicated, and no good file may be replaced by a broken one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from calibrate.errors import UserError
from calibrate.jsonfile import write_json
from calibrate.lock import LOCK_NAME, DirLock
from calibrate.outputs import write_atomic
from calibrate.results import SAMPLE_FIELDS, ResultsDir
from tests.cli.badrecords import make_results

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).with_name("mpiexec")
ENV = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


def _keys(df: pd.DataFrame) -> list[tuple]:
    return list(zip(df["group"], df["collective"], df["bytes"].astype(int)))


# ---- kill -9 ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not MPIEXEC.exists(), reason="the mpich wheel's mpiexec is not installed")
def test_kill_9_mid_run_then_resume(tmp_path):
    """A 2-rank calibration killed (SIGKILL, the whole job) after a few sizes, then resumed: every size
    measured before the kill is kept as it was, none is measured twice, and the resumed run takes
    over the dead run's lock and completes the sweep."""
    out = tmp_path / "res"
    args = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "calibrate", "run", "--backend", "mpi", "-b", "1K",
            "-e", "256K", "-f", "1.5", "-c", "allreduce", "--groups", "world", "--iters", "2", "--warmup", "0",
            "--reps", "2", "--min-batch-ms", "20", "--out", str(out)]
    job = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           start_new_session=True)
    stats = out / "stats.csv"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and job.poll() is None:
            if stats.exists() and len(stats.read_text().splitlines()) >= 4:  # header and three sizes
                break
            time.sleep(0.05)
        assert job.poll() is None, f"the run ended before it could be killed: {job.stderr.read()[-500:]}"
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert (out / LOCK_NAME).exists(), "the killed run's lock is gone: the kill came too late to test takeover"
    kept = pd.read_csv(stats)
    # a kill between a size's samples and its stats row: samples of a size without stats (planted here
    # as well, in case the kill landed elsewhere) must not survive the resume
    n_orphan = 3
    with open(out / "samples.csv", "a") as f:
        for rep in range(n_orphan):
            f.write(f"world:2x1,intra,2,1,allreduce,host,float32,99999744,24999936,{rep},0.5\r\n")
    r = subprocess.run(args + ["--resume"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    after = pd.read_csv(stats)
    samples = pd.read_csv(out / "samples.csv")
    assert len(set(_keys(after))) == len(after), "a size measured twice"
    meta = json.loads((out / "meta.json").read_text())
    assert sorted(after["bytes"]) == sorted(meta["config"]["sizes"]), "the sweep is incomplete"
    merged = kept.merge(after, on=["group", "collective", "bytes"], suffixes=("", "_after"))
    assert len(merged) == len(kept) and (merged["median_s"] == merged["median_s_after"]).all(), "a result was lost"
    assert set(_keys(samples)) == set(_keys(after)), "samples of a size without a stats row survived"
    assert (samples.groupby(["group", "collective", "bytes"]).size() == 2).all(), "samples duplicated"
    assert not (out / LOCK_NAME).exists(), "the lock outlived the run"


# ---- a full disk -------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (as root), unmounted after the test."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(folder: Path) -> None:
    """Fill the file system of ``folder`` to the last byte."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
                f.flush()
        except OSError:
            pass


def test_full_disk_keeps_the_good_file(small_disk):
    plan = small_disk / "plan.json"
    good = {"kind": "x", "version": 1, "rows": list(range(1000))}
    write_json(plan, good)
    _fill(small_disk)
    with pytest.raises(UserError, match=r"cannot write the plan file .*plan\.json.*No space left"):
        write_json(plan, {**good, "rows": list(range(20000))}, "plan file")
    assert json.loads(plan.read_text()) == good, "the good plan was replaced by a broken one"
    with pytest.raises(UserError, match="No space left"):
        write_atomic(small_disk / "report.html", "<html>" + "x" * 100000, "report")
    assert not (small_disk / "report.html").exists()
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "plan.json"], "a temporary file was left"


def test_full_disk_mid_calibration_loses_nothing(small_disk):
    """Appending a size to a results directory on a full disk: a one-line error naming the file, the
    sizes before it intact; the resume drops the torn part and measures that size again."""
    res = make_results(small_disk / "res", collectives=("allreduce",))
    stats_before = (res / "stats.csv").read_text()
    meta = json.loads((res / "meta.json").read_text())
    _fill(small_disk)
    rd = ResultsDir(res)
    base = {"group": "world:2x1", "tier": "intra", "ranks": 2, "nodes": 1, "collective": "allgather",
            "mode": "host", "dtype": "float32", "bytes": 1 << 20, "count": 1 << 18}
    rows = [dict(base, rep=i, time_s=1e-3) for i in range(4000)]
    with pytest.raises(UserError, match=r"samples\.csv.*No space left.*--resume"):
        rd.append(rows, dict(base, n=4000, median_s=1e-3), None)
    assert (res / "stats.csv").read_text() == stats_before
    (small_disk / "filler").unlink()
    done = rd.prepare(meta, resume=True)
    rd.close()
    assert ("world:2x1", "allgather", 1 << 20) not in done
    samples = rd.samples()
    assert "allgather" not in set(samples["collective"]), "torn samples of the failed size survived"
    assert len(pd.read_csv(res / "samples.csv")) == len(samples)


# ---- two writers ---------------------------------------------------------------------------------------
HOLD = ("import sys, time; from calibrate.lock import DirLock; l = DirLock(sys.argv[1], 'results directory')"
        ".acquire(); print('held', flush=True); time.sleep(60)")


def test_two_writers(tmp_path):
    folder = tmp_path / "res"
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"in use by process {other.pid} on .*remove .*{LOCK_NAME}"):
            DirLock(folder, "results directory").acquire()
        meta = json.loads((make_results(tmp_path / "proto") / "meta.json").read_text())
        with pytest.raises(UserError, match="in use by process"):
            ResultsDir(folder).prepare(meta, resume=False)
        assert not (folder / "meta.json").exists(), "the refused writer wrote"
    finally:
        other.kill()
        other.wait()
    # the holder died without unlocking (kill -9): its lock is stale and taken over
    with DirLock(folder) as lock:
        assert lock.holder()[1] == os.getpid()
    assert not (folder / LOCK_NAME).exists()


def test_a_lock_held_by_a_killed_process_not_yet_reaped_is_stale(tmp_path):
    """A zombie holder (kill -9'd MPI ranks stay zombies until reaped) is dead: its lock is taken over."""
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        other.kill()
        stat = Path(f"/proc/{other.pid}/stat")
        deadline = time.monotonic() + 30
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)  # killed, not reaped (no wait yet): a zombie
        with DirLock(tmp_path) as lock:
            assert lock.holder()[1] == os.getpid()
    finally:
        other.wait()


def test_a_lock_file_left_empty_is_stale_after_a_while(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")
    with pytest.raises(UserError, match="in use by another process"):
        DirLock(tmp_path).acquire()
    old = time.time() - 60
    os.utime(tmp_path / LOCK_NAME, (old, old))
    DirLock(tmp_path).acquire().release()


def test_resume_drops_samples_of_sizes_without_stats(tmp_path):
    """The kill between samples.csv and stats.csv, planted: the resume keeps only whole sizes."""
    res = make_results(tmp_path / "res", collectives=("allreduce",))
    samples_before = (res / "samples.csv").read_text()
    with open(res / "samples.csv", "a") as f:
        f.write(",".join(["world:2x1", "intra", "2", "1", "allreduce", "host", "float32", "12345", "3086", "0",
                          "0.001"]) + "\r\n")
        f.write("world:2x1,intra,2,1,allre")  # torn
    assert len(SAMPLE_FIELDS) == 11
    meta = json.loads((res / "meta.json").read_text())
    rd = ResultsDir(res)
    rd.prepare(meta, resume=True)
    rd.close()
    assert (res / "samples.csv").read_text() == samples_before


# ---- files that belong together, and what a killed writer leaves ------------------------------------------
def test_full_disk_writes_neither_of_a_pair(small_disk):
    """plan.json and report.html: a disk that fills while the second is written keeps both old files."""
    from calibrate.outputs import write_together
    write_together({small_disk / "plan.json": "old plan", small_disk / "report.html": "old report"})
    (small_disk / "filler").write_bytes(b"\0" * (150 * 1024))
    with pytest.raises(UserError, match=r"cannot write the plan and report .*No space left"):
        write_together({small_disk / "plan.json": "new plan", small_disk / "report.html": "x" * 200000},
                       "plan and report")
    assert (small_disk / "plan.json").read_text() == "old plan" and (small_disk / "report.html").read_text() == \
        "old report", "one of the pair was replaced without the other"
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "plan.json", "report.html"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_writers_leftovers_are_finished_or_removed_by_the_next_writer(tmp_path):
    """A kill -9 between a pair's renames (its journal names the complete temporaries): the next writer in the
    folder finishes the renames; temporaries of a dead process are removed, a live one's kept."""
    from calibrate.outputs import JOURNAL, _host, remove_stale
    dead, host = _dead_pid(), _host()
    (tmp_path / "plan.json").write_text("new plan")  # renamed before the kill
    tmp_report = tmp_path / f".report.html.{host}.{dead}.abc.tmp"
    tmp_report.write_text("new report")
    (tmp_path / f"{JOURNAL}.{host}.{dead}").write_text(json.dumps([[f".plan.json.{host}.{dead}.xyz.tmp", "plan.json"],
                                                                   [tmp_report.name, "report.html"]]))
    (tmp_path / "report.html").write_text("old report")
    stale = tmp_path / f".big.xml.{host}.{dead}.q1.tmp"
    stale.write_bytes(b"\0" * 1000)
    live = tmp_path / f".big.xml.{host}.{os.getpid()}.q2.tmp"
    live.write_bytes(b"\0")
    other_host = tmp_path / f".big.xml.elsewhere.{dead}.q3.tmp"
    other_host.write_bytes(b"\0")
    with DirLock(tmp_path):  # taking the lock cleans up
        pass
    assert (tmp_path / "report.html").read_text() == "new report"
    assert not stale.exists() and live.exists() and other_host.exists()
    assert not list(tmp_path.glob(JOURNAL + "*"))
    assert remove_stale(tmp_path) == []


SLOW_WRITE = """
import sys, time
from calibrate.cli import run_cli
from calibrate.outputs import write_atomic

class Slow(str):
    def encode(self, *a):  # the temporary file exists while its content is made
        print("writing", flush=True)
        time.sleep(60)
        return b""

sys.exit(run_cli(lambda argv: write_atomic(sys.argv[1], Slow("x"), "program XML"), [], prog="demo"))
"""


def test_sigterm_mid_write_removes_the_temporary_file(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", SLOW_WRITE, str(tmp_path / "big.xml")], cwd=ROOT, env=ENV,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "writing"
        assert list(tmp_path.glob(".big.xml.*.tmp")), "no temporary file to remove"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        p.kill()
    assert list(tmp_path.iterdir()) == [], "the temporary file was left"


def test_a_lock_path_that_is_a_directory_or_unwritable_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "a" / LOCK_NAME).mkdir(parents=True)
    with pytest.raises(UserError, match=r"the lock file .*\.commtune\.lock' of the output directory is not a file"):
        DirLock(tmp_path / "a").acquire()
    real_open = os.open

    def read_only(path, flags, *a):  # as a read-only --out (root may write anywhere, so the error is planted)
        if str(path).endswith(LOCK_NAME):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a)
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(UserError, match=r"cannot lock the output directory .*\(Permission denied\): choose a "
                                        r"writable directory"):
        DirLock(tmp_path / "b").acquire()


def test_every_directory_writer_refuses_a_folder_locked_on_another_host(tmp_path):
    """schedule, execute (tests/autotune/test_execute_input.py) and validate take the --out lock before any
    work, a lock from another host included; under mpiexec every rank ends at once."""
    from tests.cli.badrecords import run_main
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text("otherhost 77 1700000000\n")
    rc, text, _, tb = run_main(["autotune", "schedule", "--model-only", "--out", str(out)])
    assert rc == 2 and not tb and "in use by process 77 on otherhost" in text.strip().splitlines()[-1]
    if MPIEXEC.exists():
        t0 = time.monotonic()
        r = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "autotune", "validate", "--out", str(out)],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and time.monotonic() - t0 < 30
        assert "in use by process 77 on otherhost" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def test_schedule_on_a_full_disk_leaves_no_programs_without_their_manifest(small_disk):
    """The disk fills while the programs are written: the old programs and manifest are kept, nothing
    half-written is left (no staging folder, no temporary file)."""
    from tests.cli.badrecords import run_main
    out = small_disk / "tuned"
    (out / "programs").mkdir(parents=True)
    (out / "programs" / "old.xml").write_text("<algo/>")
    (out / "manifest.json").write_text('{"old": true}')
    st = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 12 * 1024))  # one program fits
    rc, text, _, tb = run_main(["autotune", "schedule", "--model-only", "--collective", "allreduce", "--gpus", "2",
                                "--sizes", "1K:64K:4", "--out", str(out)])
    assert rc == 2 and not tb and "No space left" in text.strip().splitlines()[-1], text[-500:]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "programs"]
    assert [p.name for p in (out / "programs").iterdir()] == ["old.xml"]
    assert (out / "manifest.json").read_text() == '{"old": true}'
