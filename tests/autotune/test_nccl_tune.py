"""autotune nccl without GPUs: the settings, the sweep's pruning and the choice per band on
a stand-in session (known times), the record and its summary against closed forms, the env
file, and the command's refusals."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest

from autotune.nccl import record as rec
from autotune.nccl.choose import choose
from autotune.nccl.cli import main
from autotune.nccl.measure import Options, check_environment, compare, sweep
from autotune.nccl.settings import DEFAULT, Setting, candidates, parse_channels, setting_table
from calibrate.errors import UserError
from kernels.nccl_tuner.table import ENV_TABLE, SIZE_MAX, Row, read_table, write_table


def test_candidates_per_collective():
    ar = candidates("allreduce", 2, 1, (-1, 64))
    assert ar[0] == DEFAULT and len(ar) == 1 + 2 * 3 * 2
    assert {s.algorithm for s in ar[1:]} == {"ring", "tree"}
    assert {s.algorithm for s in candidates("allgather", 2, 1)[1:]} == {"ring"}
    assert {s.algorithm for s in candidates("reducescatter", 4, 4)[1:]} == {"ring", "pat"}  # one rank per node
    assert len(candidates("broadcast", 8, 2, (-1, 16, 32, 64))) == 1 + 3 * 4
    with pytest.raises(UserError, match="tunes"):
        candidates("alltoall", 2, 1)
    assert Setting.parse("ring/ll128/auto") == Setting("ring", "ll128", -1)
    assert Setting.parse(Setting("tree", "simple", 32).label) == Setting("tree", "simple", 32)
    with pytest.raises(UserError, match="--channels"):
        parse_channels("0,16", 64)
    with pytest.raises(UserError, match="--min-ctas"):
        parse_channels("128", 64)


def test_setting_table_covers_every_size_of_its_collectives():
    rows = setting_table(Setting("tree", "ll", 16), ["allreduce", "allgather"], 2, 1)
    assert rows == [Row("allreduce", 0, SIZE_MAX, "tree", "ll", 16, 1, 2)]  # no tree allgather
    assert read_table(write_table(rows)) == rows


@dataclass
class FakeBackend:
    rows: list | None
    min_ctas: int | None
    closed: bool = False

    def close(self):
        self.closed = True


@dataclass
class FakeSession:
    """Times per (setting, collective, size) given; what a GPU session measures."""
    times: dict
    ranks: int = 2
    nodes: int = 1
    min_ctas: int = 64
    options: Options = field(default_factory=Options)
    made: list = field(default_factory=list)
    measured: list = field(default_factory=list)
    calls_decided: int = 0

    def backend(self, rows, min_ctas):
        self.made.append(FakeBackend(rows, min_ctas))
        return self.made[-1]

    def decided(self):
        return self.calls_decided

    def measure(self, be, coll, n, label, reps=None, check=True):
        assert not be.closed
        # the plugin decides the calls of every setting but ring/ll128/auto (as if NCCL had ruled it out)
        self.calls_decided += bool(be.rows) and label != "ring/ll128/auto"
        key = label if label in ("default", "tuned") else label
        t = self.times[(key, coll, n)] if (key, coll, n) in self.times else self.times[(key, n)]
        self.measured.append((label, coll, n))
        runs = "ring/ll" if label in ("default", "ring/ll/auto") else "/".join(label.split("/")[:2])
        return rec.Sample(coll, n, label, t, [t], 0 if check else -1, runs)


SIZES = [1024, 4096, 16384, 1 << 20]


def _times():
    t = {}
    for n in SIZES:
        t[("default", n)] = 10.0
        t[("ring/ll/auto", n)] = 9.0 if n <= 4096 else 12.0
        t[("ring/simple/64", n)] = 11.0 if n <= 4096 else 8.0
        t[("ring/ll128/auto", n)] = 25.0          # far behind from the start: dropped after two sizes
        t[("ring/ll128/64", n)] = 16.0 if n == 4096 else 10.5   # behind at one size only: kept
    return t


def test_sweep_prunes_and_choice_is_the_fastest_per_band():
    plan = {"allreduce": [DEFAULT] + [Setting.parse(s) for s in ("ring/ll/auto", "ring/simple/64",
                                                                 "ring/ll128/auto", "ring/ll128/64")]}
    session = FakeSession(_times())
    samples, pruned, settings_done = [], [], []

    def on_sample(s, coll, n, setting):
        (pruned.append((setting.label, n)) if s is None else samples.append(s))

    seconds = sweep(session, plan, SIZES, on_sample,
                    lambda k, total, s, sec, applied: settings_done.append((k, total, s.label, applied)))
    assert pruned == [("ring/ll128/auto", 16384), ("ring/ll128/auto", 1 << 20)]
    assert len(samples) == 5 * 4 - 2 and set(seconds) == {"allreduce", "communicators"}
    # one communicator per setting, each closed; the default's has no table and NCCL's channels
    assert len(session.made) == 5 and all(b.closed for b in session.made)
    assert session.made[0].rows is None and session.made[0].min_ctas is None
    assert session.made[2].rows == [Row("allreduce", 0, SIZE_MAX, "ring", "simple", 64, 1, 2)]
    assert session.made[2].min_ctas == 64 and settings_done[-1] == (5, 5, "ring/ll128/64", True)
    assert [s for _, _, s, applied in settings_done if not applied] == ["ring/ll128/auto"]
    rows = choose(samples, ["allreduce"], SIZES, 2, 1)
    # bands: [0, 2048) [2048, 8192) [8192, 131072) [131072, inf); the default is never a row
    assert rows == [Row("allreduce", 0, 8191, "ring", "ll", -1, 1, 2),
                    Row("allreduce", 8192, SIZE_MAX, "ring", "simple", 64, 1, 2)]
    # the default's own algorithm and protocol with NCCL's channels is kept unless beaten by more than the margin
    def near(t):
        return [dataclasses.replace(s, median_us=t) if s.setting in ("ring/simple/64", "ring/ll128/64") else s
                for s in samples]

    # at 16 KiB and 1 MiB ring/ll/auto (what the default runs, with NCCL's channels) takes 12 us
    assert choose(near(11.7), ["allreduce"], SIZES, 2, 1, margin=0.02)[-1].protocol == "simple"  # 2.5% faster
    assert choose(near(11.8), ["allreduce"], SIZES, 2, 1, margin=0.02) == \
        [Row("allreduce", 0, SIZE_MAX, "ring", "ll", -1, 1, 2)]                                    # 1.7%: kept
    # a setting NCCL did not apply is never chosen, even where it measured fastest
    assert choose(samples, ["allreduce"], SIZES, 2, 1, excluded=["ring/ll/auto"]) == \
        [Row("allreduce", 0, 2047, "ring", "ll128", 64, 1, 2),
         Row("allreduce", 2048, SIZE_MAX, "ring", "simple", 64, 1, 2)]


def test_compare_alternates_and_labels_each_size():
    rows = [Row("allreduce", 0, 8191, "ring", "ll", -1, 1, 2)]
    t = {("default", n): 10.0 for n in SIZES} | {("tuned", n): 8.0 for n in SIZES}
    session = FakeSession(t)
    got = []
    compare(session, rows, ["allreduce"], SIZES, got.append, rounds=3)
    assert [c.setting for c in got] == ["ring/ll/auto", "ring/ll/auto", "default", "default"]
    assert all(c.ratio == 1.25 and c.default_wrong == c.tuned_wrong == 0 for c in got)
    assert [m[0] for m in session.measured] == ["default", "tuned", "tuned", "default", "default", "tuned"] * 4
    assert session.made[0].rows is None and session.made[1].rows == rows and session.made[1].min_ctas == 64
    assert all(b.closed for b in session.made)


def test_summary_against_closed_forms(tmp_path):
    rows = [rec.Compare("allgather", 1024, "x", 10.0, 10.0, 0, 0),
            rec.Compare("allgather", 1 << 30, "x", 12.1, 10.0, 0, 0),
            rec.Compare("allreduce", 1024, "x", 9.7, 10.0, 0, 1)]
    s = rec.summary(rows)
    assert math.isclose(s["allgather"]["geomean"], 1.1)
    assert s["allgather"]["largest_ratio"] == pytest.approx(1.21)
    assert s["allgather"]["targets"] == {"never_slower_2pct": True, "geomean_1.05": True, "wrong_0": True,
                                         "largest_1.15": True}
    assert s["allreduce"]["targets"] == {"never_slower_2pct": False, "geomean_1.05": False, "wrong_0": False}
    r = rec.TuneRecord("d", "c", "2 x H200", 22809, 2, 1, "float32", "graph", 20, 5, 64, ["allgather"], [1024],
                       "/p.so", compare=rows, sweep=[rec.Sample("allgather", 1024, "default", 1.0, [1.0], 0)])
    r.save(tmp_path / "x.json")
    assert rec.TuneRecord.load(tmp_path / "x.json") == r
    (tmp_path / "bad.json").write_text('{"kind": "other"}')
    with pytest.raises(UserError, match="is not a NCCL tuning record"):
        rec.TuneRecord.load(tmp_path / "bad.json")


def test_env_file_names_the_plugin_the_table_and_the_channels(tmp_path):
    text = rec.env_text(tmp_path / "lib.so", tmp_path / "t.csv", 64, "header")
    assert f"export NCCL_TUNER_PLUGIN={tmp_path / 'lib.so'}" in text
    assert f"export {ENV_TABLE}={tmp_path / 't.csv'}" in text and "export NCCL_MIN_CTAS=64" in text


def test_environment_that_changes_nccls_default_is_refused(monkeypatch, tmp_path):
    plugin = tmp_path / "lib.so"
    for name in ("NCCL_ALGO", "NCCL_MIN_NCHANNELS", "NCCL_MIN_CTAS", ENV_TABLE):
        monkeypatch.setenv(name, "1")
        with pytest.raises(UserError, match=name):
            check_environment(plugin)
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_TUNER_PLUGIN", "/other.so")
    with pytest.raises(UserError, match="another plugin"):
        check_environment(plugin)
    monkeypatch.setenv("NCCL_TUNER_PLUGIN", str(plugin))
    check_environment(plugin)


@pytest.fixture
def built(tmp_path):
    from kernels.nccl_tuner.build import build

    return build(tmp_path / "lib.so")


@pytest.mark.parametrize("extra, msg", [
    (["--collectives", "alltoall"], "--collectives"),
    (["--sizes", "1K:1G"], "min:max:factor"),
    (["--channels", "16,x"], "--channels"),
    (["--min-ctas", "65"], "--min-ctas"),
    (["--prune", "1"], "--prune"),
    (["--table", "/no/such/table.csv"], "does not exist"),
])
def test_bad_input_is_one_line(built, capsys, extra, msg):
    assert main(["--plugin", str(built)] + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0] and err[0].startswith("autotune nccl: error:")


def test_plugin_not_built(tmp_path, capsys):
    assert main(["--plugin", str(tmp_path / "none.so")]) == 2
    assert "is not built: run python -m kernels build-tuner" in capsys.readouterr().err


def test_table_for_another_rank_count(built, tmp_path, capsys):
    table = tmp_path / "t.csv"
    table.write_text(write_table([Row("allreduce", 0, SIZE_MAX, "ring", "simple", 64, 1, 8)]))
    assert main(["--plugin", str(built), "--table", str(table), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "has no row for 1 ranks on 1 node(s) (it is for 8 ranks on 1 node(s))" in err


def test_report_section_from_a_record(tmp_path):
    from reports.html import write_report
    from reports.sections import builder

    rows = [rec.Compare(c, n, "ring/simple/64", 10.0, 9.0, 0, 0) for c in ("allreduce", "allgather")
            for n in (1024, 1 << 30)]
    r = rec.TuneRecord("2026-11-23", "c", "2 x H200", 22809, 2, 1, "float32", "graph", 20, 5, 64,
                       ["allreduce", "allgather"], [1024, 1 << 30], "/p.so", compare=rows, seconds={"total": 1.0})
    path = r.save(tmp_path / "nccl_tune.json")
    sections = builder("commtune.nccl-tune")([path])
    assert len(sections) == 1 and "NCCL default against NCCL tuned" in sections[0].title
    html = write_report(tmp_path / "r.html", "t", sections).read_text()
    assert "ring/simple/64" in html and "1.111" in html
