"""autotune nccl without GPUs: the settings, the sweep's pruning and the choice per band on
a stand-in session (known times), the record and its summary against closed forms, the env
file, and the command's refusals."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest

from autotune.nccl import record as rec
from autotune.nccl.choose import picks, rows_of
from autotune.nccl.cli import main
from autotune.nccl.measure import Options, ablation_arms, check_environment, compare, falling_behind, sweep
from autotune.nccl.settings import DEFAULT, Setting, candidates, parse_channels, setting_table
from calibrate.cli import message
from calibrate.errors import UserError
from calibrate.measure import engine
from kernels.nccl_tuner.table import ENV_TABLE, SIZE_MAX, Row, load_table, read_table, write_table


def choose(sweep, collectives, sizes, ranks, nodes, excluded=(), margin=0.02):
    """The rows of the sweep's picks, unconfirmed (``confirm`` keeps those whose gain holds)."""
    return rows_of(picks(sweep, collectives, sizes, excluded, margin), ranks, nodes)


def test_candidates_per_collective():
    ar = candidates("allreduce", 2, 1, (-1, 64))
    assert ar[0] == DEFAULT and len(ar) == 1 + 2 * 3 * 2
    assert {s.algorithm for s in ar[1:]} == {"ring", "tree"} and ar[1].protocol == "simple"
    assert {s.algorithm for s in candidates("allgather", 2, 1)[1:]} == {"ring"}
    assert {s.algorithm for s in candidates("reducescatter", 4, 4)[1:]} == {"ring", "pat"}  # one rank per node
    assert len(candidates("broadcast", 8, 2, (-1, 16, 32, 64))) == 1 + 3 * 4
    with pytest.raises(UserError, match="tunes"):
        candidates("alltoall", 2, 1)
    assert Setting.parse("ring/ll128/auto") == Setting("ring", "ll128", -1)
    assert Setting.parse(Setting("tree", "simple", 32).label) == Setting("tree", "simple", 32)
    with pytest.raises(UserError, match="^channels '0,16'"):
        parse_channels("0,16", 64)
    with pytest.raises(UserError) as bad:
        parse_channels("128", 64)
    assert message(bad.value) == "--channels '128': each must be -1 (NCCL's own count) or 1..64 (--min-ctas)"


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


class FakeArm(engine.Arm):
    """A collective whose every call takes ``us`` microseconds on the device (a graph replay says so)."""

    def __init__(self, be, us, nbytes, wrong_after=0):
        self.be, self.us, self.nbytes, self.wrong_after, self.checks, self.runs = be, us, nbytes, wrong_after, 0, ""

    def call(self):
        assert not self.be.closed

    def check(self, seed):
        self.checks += 1
        return self.wrong_after if self.checks == 2 else 0

    def graph(self, calls):
        return lambda: self.us * 1e-6 * calls


class FakeWorld:
    def bcast(self, x, root=0):
        return x


@dataclass
class FakeSession:
    """Times per (setting, collective, size) given; what a GPU session measures."""
    times: dict
    ranks: int = 2
    nodes: int = 1
    min_ctas: int = 64
    options: Options = field(default_factory=Options)
    default_runs: dict = field(default_factory=dict)   # size -> what NCCL's default runs (else ring/ll)
    made: list = field(default_factory=list)
    measured: list = field(default_factory=list)
    calls_decided: int = 0
    arm_times: dict = field(default_factory=dict)   # compare: (has rows, has floor) -> (us per size, wrong after)
    refuse: tuple = ()                              # compare: (has rows, has floor) whose communicator fails
    group: engine.Group = field(default_factory=engine.Solo)
    world: FakeWorld = field(default_factory=FakeWorld)

    def backend(self, rows, min_ctas):
        if (rows is not None, min_ctas is not None) in self.refuse:
            raise UserError("ncclCommInitRank failed: out of memory")
        self.made.append(FakeBackend(rows, min_ctas))
        return self.made[-1]

    def arm(self, be, coll, n):
        us, wrong = self.arm_times[(be.rows is not None, be.min_ctas is not None)]
        return FakeArm(be, us[n], n, wrong)

    def decided(self):
        return self.calls_decided

    def measure(self, be, coll, n, label, reps=None, check=True, iters=None):
        assert not be.closed
        # the plugin decides the calls of every setting but ring/ll128/auto (as if NCCL had ruled it out)
        self.calls_decided += bool(be.rows) and label != "ring/ll128/auto"
        t = self.times[(label, coll, n)] if (label, coll, n) in self.times else self.times[(label, n)]
        self.measured.append((label, coll, n, iters))
        runs = self.default_runs.get(n, "ring/ll") if label in ("default", "ring/ll/auto") else \
            "/".join(label.split("/")[:2])
        return rec.Sample(coll, n, label, t, [t], 0 if check else -1, runs)


def run_sweep(session, plan, sizes):
    samples, skipped, done = [], [], []

    def on_sample(s, coll, n, setting, why=""):
        (skipped.append((setting.label, n, why)) if s is None else samples.append(s))

    seconds = sweep(session, plan, sizes, on_sample, lambda k, total, s, sec, applied: done.append((k, total,
                                                                                                    s.label, applied)))
    return samples, skipped, done, seconds


def test_falling_behind_closed_form():
    # t = alpha + beta n: 4 us + n / 100 (bytes/us) is the best; 2x its beta and 1.6x behind: stays behind
    best = {n: 4 + n / 100 for n in (1000, 2000)}
    assert falling_behind((1000, 30.0), (2000, 50.0), best[1000], best[2000], 1.5)
    assert not falling_behind((1000, 30.0), (2000, 50.0), best[1000], best[2000], 2.1)   # 2.08x at 2000
    # behind, but growing slower than the best (a smaller beta, as Simple against LL): catching up, kept
    assert not falling_behind((1000, 30.0), (2000, 33.0), best[1000], best[2000], 1.5)
    # the best in its latency regime (beta n < alpha): nothing is dropped whatever the setting does
    lat = {n: 40 + n / 100 for n in (1000, 2000)}
    assert not falling_behind((1000, 100.0), (2000, 150.0), lat[1000], lat[2000], 1.5)


def test_sweep_channels_drops_communicators_and_what_nccl_did_not_apply():
    sizes = [1024, 4096, 256 << 10, 1 << 20, 4 << 20]
    t = {}
    for n in sizes:
        t[("default", n)] = 10.0 + n / 1000
        t[("ring/simple/64", n)] = 16.0 + n / 1000    # the first setting: the best to beat
        t[("ring/ll128/auto", n)] = 12.0 + n / 900
        t[("ring/ll/auto", n)] = 6.0 + n / 100        # 10x the beta: dropped after two steps behind
    plan = {"allreduce": [DEFAULT] + [Setting.parse(s) for s in ("ring/simple/64", "ring/ll128/auto",
                                                                 "ring/ll/auto")]}
    session = FakeSession(t)
    samples, skipped, done, seconds = run_sweep(session, plan, sizes)
    # fixed channel counts only from channels_from (256K) up; LL behind at 256K->1M and 1M->4M... no: it
    # is dropped after two steps in a row behind, so measured at 256K, 1M, dropped from there on
    assert [(lab, n) for lab, n, why in skipped if why == "channels"] == [("ring/simple/64", 1024),
                                                                         ("ring/simple/64", 4096)]
    assert [(lab, n) for lab, n, why in skipped if why == "behind"] == []
    assert len(samples) == 4 * 5 - 2 and set(seconds) == {"allreduce", "communicators"}
    # one communicator per setting, each closed; the default's has no table and NCCL's channels
    assert len(session.made) == 4 and all(b.closed for b in session.made)
    assert session.made[0].rows is None and session.made[0].min_ctas is None
    assert session.made[1].rows == [Row("allreduce", 0, SIZE_MAX, "ring", "simple", 64, 1, 2)]
    assert session.made[1].min_ctas == 64 and done[-1] == (4, 4, "ring/ll/auto", True)
    assert [s for _, _, s, applied in done if not applied] == ["ring/ll128/auto"]
    # with more sizes LL falls behind at two steps in a row (256K->1M, 1M->4M) and is not measured above
    more = sizes + [16 << 20, 64 << 20]
    t |= {(lab, n): t0 + n / beta for n in more[-2:]
          for lab, t0, beta in (("default", 10.0, 1000), ("ring/simple/64", 16.0, 1000),
                                ("ring/ll128/auto", 12.0, 900), ("ring/ll/auto", 6.0, 100))}
    _, skipped, _, _ = run_sweep(FakeSession(t), plan, more)
    assert [(lab, n) for lab, n, why in skipped if why == "behind"] == [("ring/ll/auto", 16 << 20),
                                                                       ("ring/ll/auto", 64 << 20)]


GiB = 1 << 30
CROSSOVER_SIZES = [1 << k for k in range(10, 31)]     # 1K..1G, factor 2, as the GPU run


def crossover_times(sizes):
    """A sweep with NCCL's protocol crossover, alpha-beta per protocol (us, bytes/us): LL fastest below
    1 MiB (alpha 6, beta 1/80e3), Simple above (alpha 16, beta 1/360e3), LL128 never; fewer channels
    less bandwidth; tree 1 us later and 10% slower; NCCL's default runs LL with its own channels below
    2 MiB and Simple with 32 channels' bandwidth from 2 MiB on (what it picks itself)."""
    proto = {"ll": (6.0, 80e3), "ll128": (14.0, 150e3), "simple": (16.0, 360e3)}
    share = {"auto": 1.0, "16": 0.5, "32": 0.8, "64": 1.0}
    algo = {"ring": (0.0, 1.0), "tree": (1.0, 0.9)}
    t, runs = {}, {}
    for n in sizes:
        for a, (da, fa) in algo.items():
            for p, (alpha, bw) in proto.items():
                for c, f in share.items():
                    t[(f"{a}/{p}/{c}", n)] = alpha + da + n / (bw * f * fa)
        big = n >= 2 << 20
        t[("default", n)] = 16.0 + n / (360e3 * 0.8) if big else 6.0 + n / 80e3
        runs[n] = "ring/simple" if big else "ring/ll"
    return t, runs


def test_protocol_crossover_table_picks_simple_large_and_never_slower_than_default():
    """The first GPU run's failure: a setting behind at small sizes was dropped for every larger size,
    so Simple (losing to LL below 1 MiB) was never measured where it wins, and a band took a setting
    measured only at another size: LL at 1 GiB, 0.54x of NCCL's default."""
    times, runs = crossover_times(CROSSOVER_SIZES)
    plan = {"allreduce": candidates("allreduce", 2, 1)}
    session = FakeSession(times, default_runs=runs)
    samples, skipped, done, _ = run_sweep(session, plan, CROSSOVER_SIZES)
    measured = {(s.setting, s.bytes) for s in samples}
    assert {("ring/simple/64", GiB), ("ring/simple/auto", GiB), ("tree/simple/64", GiB)} <= measured
    assert ("ring/ll/16", GiB) not in measured      # pruning still drops LL in the bandwidth regime
    rows = choose(samples, ["allreduce"], CROSSOVER_SIZES, 2, 1, [s for _, _, s, a in done if not a])
    for n in CROSSOVER_SIZES:
        row = next(r for r in rows if r.covers("allreduce", n))
        label = Setting(row.algorithm, row.protocol, row.channels).label
        assert (label, n) in measured, f"{label} chosen at {n} where it was not measured"
        assert times[(label, n)] <= times[("default", n)] * (1 + 1e-9), f"{label} slower than default at {n}"
        if n != 1 << 20:                              # at 1 MiB both are within the margin
            assert row.protocol == ("ll" if n < 1 << 20 else "simple"), (n, label)
    big = next(r for r in rows if r.covers("allreduce", GiB))
    assert times[("default", GiB)] / times[(Setting(big.algorithm, big.protocol, big.channels).label, GiB)] \
        == pytest.approx((16 + GiB / (360e3 * 0.8)) / (16 + GiB / 360e3))     # 64 channels of Simple: 1.249x


def test_a_band_chooses_only_among_settings_measured_at_its_size():
    sizes = [1 << 20, 16 << 20, GiB]
    s = [rec.Sample("allreduce", n, lab, t, [t], 0, runs) for lab, n, t, runs in (
        ("default", 1 << 20, 13.0, "ring/ll"), ("ring/ll/64", 1 << 20, 12.0, "ring/ll"),
        ("default", 16 << 20, 77.0, "ring/simple"), ("ring/ll/64", 16 << 20, 108.0, "ring/ll"),
        ("ring/simple/auto", 16 << 20, 70.0, "ring/simple"),
        ("default", GiB, 3256.0, "ring/simple"), ("ring/simple/auto", GiB, 3000.0, "ring/simple"))]
    rows = choose(s, ["allreduce"], sizes, 2, 1)
    # 1 GiB: ring/ll/64 was not measured there (its 1 MiB figure says nothing about it)
    assert [(r.protocol, r.channels) for r in rows] == [("ll", 64), ("simple", -1)]
    # the default's own algorithm and protocol stay unless beaten by more than the margin
    close = s + [rec.Sample("allreduce", GiB, "ring/simple/64", 2960.0, [2960.0], 0, "ring/simple")]
    assert choose(close, ["allreduce"], sizes, 2, 1, margin=0.02)[-1].channels == -1      # 1.3% faster: kept
    assert choose(close, ["allreduce"], sizes, 2, 1, margin=0.01)[-1].channels == 64      # beyond 1%: taken
    # a band where no setting (or not the default) was measured gets no row: NCCL decides there
    rows = choose([x for x in s if x.bytes != GiB or x.setting == "default"], ["allreduce"], sizes, 2, 1)
    assert rows[-1].max_bytes < GiB and not any(r.covers("allreduce", GiB) for r in rows)
    # and so does one where every setting measured is slower than the default by more than the margin
    slow = [x for x in s if x.bytes != GiB or x.setting == "default"] + [
        rec.Sample("allreduce", GiB, "ring/ll/64", 6100.0, [6100.0], 0, "ring/ll")]
    assert not any(r.covers("allreduce", GiB) for r in choose(slow, ["allreduce"], sizes, 2, 1))
    # a setting NCCL did not apply is never chosen, even where it measured fastest
    assert choose(s, ["allreduce"], sizes, 2, 1, excluded=["ring/ll/64"])[0].protocol == "simple"


def test_compare_attributes_the_gain_to_each_arm():
    """The comparison's arms: NCCL's default, the channel floor alone, the table alone, both; the record
    holds each arm's median and the summary each part of the gain (closed forms: times given)."""
    SIZES = [1024, 4096, 1 << 20]
    rows = [Row("allreduce", 0, 8191, "ring", "ll", -1, 1, 2)]
    times = {(False, False): ({n: 10.0 for n in SIZES}, 0), (False, True): ({n: 9.0 for n in SIZES}, 0),
             (True, False): ({n: 8.5 for n in SIZES}, 0), (True, True): ({n: 8.0 for n in SIZES}, 0)}
    session = FakeSession({}, arm_times=times)
    got = []
    compare(session, {"allreduce": ablation_arms(rows, 64)}, SIZES, got.append, rounds=3)
    assert [c.setting for c in got] == ["ring/ll/auto", "ring/ll/auto", "default"]
    assert all(c.ratio == pytest.approx(1.25) and c.default_wrong == c.tuned_wrong == 0 for c in got)
    assert [a["name"] for a in got[0].arms] == ["default", "min_ctas", "table", "tuned"]
    assert all(len(a["samples_s"]) == 3 * session.options.reps for a in got[0].arms)
    # one communicator per arm, made once for every size and closed; floor and table as named
    assert [(b.rows, b.min_ctas) for b in session.made] == [(None, None), (None, 64), (rows, None), (rows, 64)]
    assert all(b.closed for b in session.made)
    s = rec.summary(got)["allreduce"]
    assert s["against_default"] == pytest.approx({"min_ctas": 10 / 9, "table": 10 / 8.5})
    assert s["tuned_over"] == pytest.approx({"min_ctas": 9 / 8, "table": 8.5 / 8})
    assert s["targets"] == {"never_slower_2pct": "met", "geomean_1.05": "met", "wrong_0": "met"}


def test_a_missing_or_wrong_arm_is_a_row_and_the_verdict_unknown():
    SIZES = [1024, 4096]
    rows = [Row("allreduce", 0, SIZE_MAX, "ring", "ll", -1, 1, 2)]
    times = {(False, False): ({n: 10.0 for n in SIZES}, 0), (False, True): ({n: 9.0 for n in SIZES}, 0),
             (True, False): ({n: 8.5 for n in SIZES}, 3), (True, True): ({n: 8.0 for n in SIZES}, 0)}
    got = []
    compare(FakeSession({}, arm_times=times, refuse=((True, True),)), {"allreduce": ablation_arms(rows, 64)},
            SIZES, got.append)
    c = got[0]
    tuned = next(a for a in c.arms if a["name"] == "tuned")
    assert tuned["status"] == "failed" and "out of memory" in tuned["reason"] and c.tuned_us is None
    table = next(a for a in c.arms if a["name"] == "table")
    assert table["status"] == "wrong" and table["wrong_after"] == 3 and c.arm_us("table") is None
    s = rec.summary(got)["allreduce"]
    assert s["targets"]["geomean_1.05"] == "unknown" and s["targets"]["wrong_0"] == "not met"
    assert "tuned at 1024 B: failed" in next(v["why"] for v in s["verdicts"] if v["target"] == "geomean_1.05")


def test_best_fixed_setting_is_the_one_setting_best_over_every_size():
    from autotune.nccl.choose import best_fixed

    times, _ = crossover_times(CROSSOVER_SIZES)
    samples = [rec.Sample("allreduce", n, lab, t, [t], 0) for (lab, n), t in times.items()]
    label = best_fixed(samples, "allreduce")
    geo = {lab: math.exp(sum(math.log(times[(lab, n)] / times[("default", n)]) for n in CROSSOVER_SIZES)
                         / len(CROSSOVER_SIZES)) for lab in {k[0] for k in times} - {"default"}}
    assert geo[label] == pytest.approx(min(geo.values()))          # ring/simple/auto and /64 tie here
    assert best_fixed(samples, "allreduce", excluded=[label]) != label
    assert best_fixed(samples, "allgather") is None


def test_summary_against_closed_forms(tmp_path):
    rows = [rec.Compare("allgather", 1024, "x", 10.0, 10.0, 0, 0),
            rec.Compare("allgather", 1 << 30, "x", 12.1, 10.0, 0, 0),
            rec.Compare("allreduce", 1024, "x", 9.7, 10.0, 0, 1)]
    s = rec.summary(rows)
    assert math.isclose(s["allgather"]["geomean"], 1.1)
    assert s["allgather"]["largest_ratio"] == pytest.approx(1.21)
    assert s["allgather"]["targets"] == {"never_slower_2pct": "met", "geomean_1.05": "met", "wrong_0": "met",
                                         "largest_1.15": "met"}
    assert s["allreduce"]["targets"] == {"never_slower_2pct": "not met", "geomean_1.05": "not met",
                                         "wrong_0": "not met"}
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
    (["--channels-from", "big"], "bad size"),
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


def test_a_row_whose_gain_does_not_hold_at_sizes_it_was_not_tuned_on_is_dropped():
    """Issue 45: a table row replaces NCCL's choice only where its gain is confirmed at sizes the sweep
    did not measure. Planted: tree/simple/64 measured fastest at 64 MiB (a lucky sample) but 2x slower
    than the default beside it: chosen by the sweep, dropped by the confirmation (NCCL decides there);
    Simple with all channels at large sizes (1.25x, closed form) is kept; the default's own setting at
    small sizes (no gain) gets no row."""
    from types import SimpleNamespace

    from autotune.nccl.choose import confirmation_sizes
    from autotune.nccl.cli import confirmed
    from autotune.nccl.bands import bands_for

    sizes = CROSSOVER_SIZES
    extra = confirmation_sizes(sizes, 256)
    assert not set(extra) & set(sizes) and all(any(b.covers(n) for n in extra) for b in bands_for(sizes))
    times, runs = crossover_times(sorted(sizes + extra))
    planted = 64 << 20
    times[("tree/simple/64", planted)] = 0.5 * times[("default", planted)]
    for n in extra:
        if planted / 2 < n < 2 * planted:
            times[("tree/simple/64", n)] = 2 * times[("default", n)]
    session = FakeSession(times, default_runs=runs)
    samples, _, _, _ = run_sweep(session, {"allreduce": candidates("allreduce", 2, 1)}, sizes)
    chosen = picks(samples, ["allreduce"], sizes)
    assert any(p.label == "tree/simple/64" and p.band.covers(planted) for p in chosen)
    record = SimpleNamespace(heldout={}, confirm=[], confirmations=[], declined=[])
    keep = confirmed(session, record, chosen, ["allreduce"], sizes, 2, SimpleNamespace(margin=0.02),
                     lambda *a: None, lambda: None)
    assert not any(p.band.covers(planted) for p in keep) and record.declined == []
    assert any("tree/simple/64: 0." in line and "dropped" in line for line in record.confirmations)
    rows = rows_of(keep, 2, 1)
    assert rows and all(r.protocol == "simple" and r.min_bytes > 1 << 20 for r in rows)
    for p in keep:   # a kept row is faster than the default at every confirmation size of its band
        for n in (n for n in extra if p.band.covers(n)):
            assert times[(p.label, n)] < times[("default", n)] / 1.02
    # where no setting beats the default at the sizes beside the sweep's, the collective gets no rows
    flat = {k: (times[("default", k[1])] if k[0] != "default" and k[1] in extra else v) for k, v in times.items()}
    record = SimpleNamespace(heldout={}, confirm=[], confirmations=[], declined=[])
    keep = confirmed(FakeSession(flat, default_runs=runs), record, chosen, ["allreduce"], sizes, 2,
                     SimpleNamespace(margin=0.02), lambda *a: None, lambda: None)
    assert keep == [] and record.declined == ["allreduce"]


def _arms_row(coll, n, setting, default, tuned, floor=None, table=None):
    """A comparison row at a held-out size with its arms (us): NCCL_MIN_CTAS alone as the default and the
    table alone as tuned unless given."""
    arms = [{"name": name, "status": "ok", "median_s": us * 1e-6}
            for name, us in (("default", default), ("min_ctas", floor or default), ("table", table or tuned),
                             ("tuned", tuned))]
    return rec.Compare(coll, n, setting, default, tuned, 0, 0, arms=arms)


def test_evaluate_declines_a_collective_whose_gain_does_not_hold_at_the_held_out_sizes(tmp_path):
    """Issue 45, item 2: at evaluate's held-out sizes a collective's table stands only where its gain is
    confirmed (closed forms: times given). allgather: its row 1.25x at both sizes it covers: kept;
    allreduce: 1.25x inside its row but 0.95x at a size outside it: declined; reducescatter: 1.01x where
    its row applies: declined (no gain); broadcast: no held-out size in a row: declined. The evaluated
    table holds allgather's rows only, its env file NCCL_MIN_CTAS (alone it slows nothing declined)."""
    from types import SimpleNamespace

    from autotune.nccl.choose import heldout_declines
    from autotune.nccl.cli import _evaluated_table

    c = _arms_row
    rows = [c("allgather", 1 << 20, "ring/ll/64", 12.5, 10.0), c("allgather", 2 << 20, "ring/ll/64", 12.5, 10.0),
            c("allgather", 1 << 30, "default", 10.0, 10.0),
            c("allreduce", 1 << 20, "ring/ll/64", 12.5, 10.0), c("allreduce", 1 << 30, "default", 9.5, 10.0),
            c("reducescatter", 1 << 20, "ring/ll/auto", 10.1, 10.0),
            c("broadcast", 1 << 20, "default", 10.0, 10.0)]
    why = heldout_declines(rows)
    assert set(why) == {"allreduce", "reducescatter", "broadcast"}
    assert "0.950x" in why["allreduce"] and str(1 << 30) in why["allreduce"]
    assert "1.010x" in why["reducescatter"] and "no held-out size falls in its rows" in why["broadcast"]
    # a planted bug (the worst size ignored) would keep allreduce: the margin is what declines it
    assert "allreduce" not in heldout_declines(rows, margin=0.06)
    table = tmp_path / "nccl_tuner.csv"
    table.write_text(write_table([Row("allgather", 0, 4 << 20, "ring", "ll", 64, 1, 4),
                                  Row("allreduce", 0, 4 << 20, "ring", "ll", 64, 1, 4),
                                  Row("reducescatter", 0, 4 << 20, "ring", "ll", -1, 1, 4)]))
    dev = SimpleNamespace(table=str(table))

    def evaluated(compare, name):
        record = rec.EvaluateRecord("d", "c", "", "4 x H200", 22809, 4, 1, "float32", 64, str(tmp_path / "x.json"),
                                    {}, [], {}, 5, compare=compare)
        return record, _evaluated_table(record, dev, tmp_path / name, tmp_path / "lib.so")

    record, lines = evaluated(rows, "nccl_evaluate.json")
    got = load_table(tmp_path / "nccl_tuner.evaluated.csv")
    assert [r.collective for r in got] == ["allgather"] and record.table.endswith("nccl_tuner.evaluated.csv")
    env = (tmp_path / "nccl_tuner.evaluated.env").read_text()
    assert "nccl_tuner.evaluated.csv" in env and "export NCCL_MIN_CTAS=64" in env
    assert sum("declined at the held-out sizes" in line for line in lines) == 3
    _, lines = evaluated([x for x in rows if x.collective != "allgather"], "e2.json")
    assert "no table, no env file" in lines[-1]
    assert "allgather: declined at the held-out sizes: not measured" in lines[0]


def test_evaluate_leaves_nccl_min_ctas_out_where_alone_it_slows_a_declined_collective(tmp_path):
    """NCCL_MIN_CTAS reaches every collective: allreduce's 0.95x at 1 GiB comes from the floor alone (its
    table alone: 1.25x in its row, 1.0x outside), so the env file cannot keep the floor; judged by the
    table alone, allreduce and allgather stand, reducescatter (1.01x) does not."""
    from types import SimpleNamespace

    from autotune.nccl.cli import _evaluated_table

    c = _arms_row
    rows = [c("allgather", 1 << 20, "ring/ll/64", 12.5, 10.0),
            c("allreduce", 1 << 20, "ring/ll/64", 12.5, 10.0),
            c("allreduce", 1 << 30, "default", 9.5, 10.0, floor=10.0, table=9.5),
            c("reducescatter", 1 << 20, "ring/ll/auto", 10.1, 10.0)]
    table = tmp_path / "nccl_tuner.csv"
    table.write_text(write_table([Row(k, 0, 4 << 20, "ring", "ll", 64, 1, 4)
                                  for k in ("allgather", "allreduce", "reducescatter")]))
    record = rec.EvaluateRecord("d", "c", "", "4 x H200", 22809, 4, 1, "float32", 64, "x.json", {}, [], {}, 5,
                                compare=rows)
    lines = _evaluated_table(record, SimpleNamespace(table=str(table)), tmp_path / "e.json", tmp_path / "lib.so")
    assert "NCCL_MIN_CTAS left out" in lines[0] and "allreduce at 1073741824 B" in lines[0]
    assert list(record.declined) == ["reducescatter"]
    assert [r.collective for r in load_table(tmp_path / "nccl_tuner.evaluated.csv")] == ["allgather", "allreduce"]
    assert "NCCL_MIN_CTAS=" not in (tmp_path / "nccl_tuner.evaluated.env").read_text()
