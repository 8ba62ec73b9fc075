"""The schedule evaluation's arms without GPUs: the knob ablations built where the search space does
not enumerate them (the 2-GPU run of 2026-11-25 had all four as "not in the search space"), NCCL's
best setting from an NCCL run's table, the verdicts with an arm or a size missing, the rendering."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from autotune.nccl import record as rec
from autotune.schedule import outputs
from autotune.schedule.cli import _nccl_best_inputs, plan_arms
from autotune.schedule.evaluate import (ABLATION, NCCL_BEST, EvaluateRecord, Point, arms_for, finite_or_none,
                                        knob_arms, summary)
from autotune.schedule.nccl_best import NcclBest, load_nccl_run
from autotune.schedule.result import TuneResult
from autotune.schedule.space import DEFAULT_SPACE, Candidate, build_variant, enumerate_candidates, load_space
from calibrate.errors import UserError
from calibrate.measure.engine import ArmResult, Status
from calibrate.measure.heldout import Declaration
from kernels.interp import pack
from kernels.interp.preset import load_preset
from kernels.nccl_tuner.table import Row

RUN = Path(__file__).resolve().parents[2] / "reports" / "records" / "issue33-h100x2-2026-11-25"
TUNED_KEY = "direct_allreduce_2r.xml/file/Simple/b16Kx64/t128K"
FIXED_KEY = "direct_allreduce_2r.xml/file/LL/b2Kx32"


@pytest.fixture(scope="module")
def space_allreduce():
    built, _ = enumerate_candidates(load_space(DEFAULT_SPACE), "allreduce", 2, 1)
    return {b.candidate.key: b for b in built}


def changed(a: Candidate, b: Candidate) -> set[str]:
    return {f.name for f in dataclasses.fields(Candidate) if getattr(a, f.name) != getattr(b, f.name)}


def test_the_failed_pair_gets_every_ablation_built(space_allreduce):
    by_key = dict(space_allreduce)
    tuned, fixed = by_key[TUNED_KEY].candidate, by_key[FIXED_KEY].candidate
    arms = knob_arms(tuned, fixed, by_key, "allreduce", 2, 1)
    knobs = ("protocol", "bytes_per_block", "max_split", "tile_bytes")
    assert list(arms) == [ABLATION.format(k) for k in knobs]
    outside = 0
    for k in knobs:
        b = arms[ABLATION.format(k)]
        assert not isinstance(b, str), b
        assert changed(b.candidate, tuned) == {k} and getattr(b.candidate, k) == getattr(fixed, k)
        assert b.program.protocol.value == b.candidate.protocol and b.program.ngpus == 2
        outside += b.candidate.key not in space_allreduce
    assert outside == 4                     # LL with a tile cap, two block pairs, Simple without one: none enumerated
    again = knob_arms(tuned, fixed, by_key, "allreduce", 2, 1)
    assert all(again[n] is arms[n] for n in arms)         # built once, reused at the next size


def test_library_pair_differing_in_every_knob(space_allreduce):
    by_key = dict(space_allreduce)
    tuned = next(b.candidate for b in by_key.values() if b.candidate.key.startswith("ring_allreduce/c2i4/Simple/"
                                                                                    "b16Kx64/t128K"))
    fixed = next(b.candidate for b in by_key.values() if b.candidate.key == "allpairs_allreduce/c1i1/LL/b2Kx32")
    arms = knob_arms(tuned, fixed, by_key, "allreduce", 2, 1)
    assert set(arms) == {ABLATION.format(k) for k in ("algorithm", "channels", "instances", "protocol",
                                                      "bytes_per_block", "max_split", "tile_bytes")}
    for name, b in arms.items():
        assert not isinstance(b, str), (name, b)
        assert changed(b.candidate, tuned) == {name.split(", ")[1].split(" as")[0]}
    # allpairs with ring's two channels and four instances: compiled although the space lists only c1
    assert arms[ABLATION.format("algorithm")].candidate.key == "allpairs_allreduce/c2i4/Simple/b16Kx64/t128K"


def test_impossible_combinations_are_rows_saying_why(space_allreduce):
    by_key = dict(space_allreduce)
    file_tuned = by_key[TUNED_KEY].candidate
    ring = next(b.candidate for b in by_key.values() if b.candidate.key.startswith("ring_allreduce/c2i2/Simple"))
    arms = knob_arms(file_tuned, dataclasses.replace(ring, protocol="LL128"), by_key, "allreduce", 2, 1)
    assert "fixes its channels (1); it cannot take 2" in arms[ABLATION.format("channels")]
    assert "fixes its instances" in arms[ABLATION.format("instances")]
    assert "does not run protocol LL128" in arms[ABLATION.format("protocol")]
    assert arms[ABLATION.format("algorithm")].candidate.key == "ring_allreduce/c1i1/Simple/b16Kx64/t128K"
    hier = dataclasses.replace(ring, algorithm="hierarchical_allreduce")
    with pytest.raises(UserError, match="does not build"):
        build_variant(hier, "allreduce", 2, 1)
    gather = Candidate("ring_allgather", "library", 1, 1, "Simple", 16384, 64, 0)
    with pytest.raises(UserError, match="is a allgather, not a allreduce"):
        build_variant(gather, "allreduce", 2, 1)


def _failed_run():
    result = TuneResult.load(RUN)
    return result, Declaration.from_dict(result.heldout, "schedule.json")


def test_the_recorded_run_plans_its_ablations_at_the_sizes_that_failed():
    result, declaration = _failed_run()
    plans = plan_arms(result, declaration, load_space(result.space))
    sizes = declaration.evaluation["allreduce"]
    assert sizes == [18176, 922368, 26933248, 124238336]
    for n in sizes[:2]:         # the tuned LL entry is the fixed configuration itself: no knob differs
        assert list(plans[("allreduce", n)]) == [f"fixed {FIXED_KEY}"]
    for n in sizes[2:]:
        plan = plans[("allreduce", n)]
        assert len(plan) == 5 and all(not isinstance(b, str) for b in plan.values()), plan
    assert plans[("allreduce", sizes[2])][ABLATION.format("protocol")] is \
        plans[("allreduce", sizes[3])][ABLATION.format("protocol")]


def test_the_interpreter_selects_each_ablation_at_its_size(space_allreduce):
    """arms_for on a stand-in communicator (ranks and preset: all that selection reads): every built
    ablation is a program launch at 26.9 MB, NCCL's-best and reasons pass as given."""
    result, declaration = _failed_run()
    plans = plan_arms(result, declaration, load_space(result.space))
    n = 26933248
    plan = plans[("allreduce", n)]
    built = [b for b in plan.values() if not isinstance(b, str)]
    tuned = space_allreduce[TUNED_KEY]
    preset = outputs.transport_preset(load_preset("h200x2"), built + [tuned], (), "t")
    comm = SimpleNamespace(nranks=2, preset=preset)
    others = {name: [(outputs.entry_for(b.candidate, b.program.name), b.program)] for name, b in plan.items()}
    others["an impossible one"] = "why not"
    count = n // pack.DTYPES["float32"]
    arms, label = arms_for(comm, "allreduce", count, "float32",
                           [(outputs.entry_for(tuned.candidate, tuned.program.name), tuned.program)], others,
                           {NCCL_BEST: None})
    assert label.endswith("(Simple, split 64)") and arms["nccl"] is None and arms[NCCL_BEST] is None
    for name in plan:
        assert not arms[name].uses_nccl and arms[name].program is plan[name].program, name
    assert arms[ABLATION.format("max_split")].split == 32 and arms[ABLATION.format("protocol")].protocol.value == "LL"
    assert isinstance(arms["an impossible one"], UserError)


def _nccl_run(tmp_path, **kw):
    rows = [Row("allreduce", 2048, 2097151, "ring", "ll", -1, 1, 2),
            Row("allreduce", 8388608, 2 ** 64 - 1, "ring", "simple", -1, 1, 2)]
    fields = dict(date="d", command="c", device="2 x NVIDIA H100", nccl_version=22809, ranks=2, nodes=1,
                  dtype="float32", mode="graph", iters=20, reps=5, min_ctas=64, collectives=["allreduce"],
                  sizes=[1024, 16384, 1 << 20, 1 << 24], plugin=str(tmp_path / "absent.so"),
                  sweep=[rec.Sample("allreduce", 1024, "default", 6.0, [6.0], 0)],
                  table=str(tmp_path / "nccl_tuner.csv"), table_rows=[r.line() for r in rows]) | kw
    rec.TuneRecord(**fields).save(tmp_path / "nccl_tune.json")
    return tmp_path


def test_nccl_best_is_the_nccl_runs_row_for_the_size(tmp_path):
    best = load_nccl_run(str(_nccl_run(tmp_path)), 2, 1, "float32")
    assert best.setting("allreduce", 18176).algorithm == "ring" and best.setting("allreduce", 18176).protocol == "ll"
    assert best.label("allreduce", 26933248) == "ring/simple/auto with NCCL_MIN_CTAS=64"
    assert best.setting("allreduce", 4 << 20) is None          # no row: the sweep kept NCCL's default there
    assert best.label("allreduce", 4 << 20).startswith("NCCL's default")
    assert "measured 16384 B" in best.setting("allreduce", 16384)      # a sweep size is not held out
    assert "did not tune allgather" in best.setting("allgather", 18176)
    assert best.to_dict()["table_rows"][0] == "allreduce,2048,2097151,ring,ll,-1,1,2"


@pytest.mark.parametrize("kw,args,msg", [({"ranks": 4}, (2, 1, "float32"), "measured on 4 ranks"),
                                         ({}, (2, 1, "float16"), "measured float32"),
                                         ({"sweep": []}, (2, 1, "float32"), "no development sweep"),
                                         ({"table": "", "table_rows": []}, (2, 1, "float32"), "wrote no table")])
def test_nccl_run_of_another_job_refused(tmp_path, kw, args, msg):
    with pytest.raises(UserError, match=msg):
        load_nccl_run(str(_nccl_run(tmp_path, **kw)), *args)


def test_nccl_run_without_a_built_plugin_refused_before_gpu_work(tmp_path):
    result, _ = _failed_run()
    args = SimpleNamespace(nccl_run=str(_nccl_run(tmp_path)), plugin=str(tmp_path / "nope.so"))
    with pytest.raises(UserError, match="not built: run python -m kernels build-tuner"):
        _nccl_best_inputs(args, result)
    assert _nccl_best_inputs(SimpleNamespace(nccl_run=None, plugin=None), result) == (None, None)


def arm(name, us=None, status=Status.OK, reason=""):
    a = ArmResult(name, status, reason, 20, [us * 1e-6] * 3 if us else [], 0 if us else -1, 0 if us else -1)
    return a.to_dict() | {"max_rel_err": 0.0 if us else None}


def _points(best_status=Status.OK):
    out = []
    for n, (t, nc, nb) in ((3000, (4.0, 6.0, 5.0)), (9000, (10.0, 11.0, 10.5))):
        best = arm(NCCL_BEST, nb) if best_status is Status.OK else arm(NCCL_BEST, status=best_status,
                                                                        reason="did not start: no --nccl-run given")
        out.append(Point("allreduce", n, "x", [arm("tuned", t), arm("nccl", nc), best, arm("fixed k", t * 1.2),
                                               arm(ABLATION.format("protocol"), t * 1.5),
                                               arm(ABLATION.format("max_split"), status=Status.FAILED,
                                                   reason="did not start: too many blocks")],
                          "ring/ll/auto with NCCL_MIN_CTAS=64"))
    return out


def test_a_missing_nccl_best_arm_makes_its_verdict_unknown_only():
    s = summary(_points(Status.FAILED))["allreduce"]
    v = {x["target"]: x for x in s["verdicts"]}
    best = v["tuned >= 0.98x NCCL's best setting at every held-out size"]
    assert best["state"] == "unknown" and "nccl best at 3000 B: failed (did not start: no --nccl-run given)" in \
        best["why"]
    assert v["tuned >= 0.98x NCCL at every held-out size"]["state"] == "met"
    assert v["tuned faster than the best fixed configuration (geomean)"]["state"] == "met"
    assert s["over_nccl_best_geomean"] is None
    assert s["knob_share"]["protocol"]["share_geomean"] == pytest.approx(1.5)
    assert s["knob_share"]["max_split"] == {"share_geomean": None, "sizes": 2, "timed": 0,
                                            "missing": ["tuned, max_split as fixed at 3000 B: failed (did not "
                                                        "start: too many blocks)", "tuned, max_split as fixed at "
                                                        "9000 B: failed (did not start: too many blocks)"]}
    ok = summary(_points())["allreduce"]
    assert ok["over_nccl_best_geomean"] == pytest.approx(math.sqrt(5 / 4 * 10.5 / 10))
    assert {x["state"] for x in ok["verdicts"]} == {"met"}


def test_a_size_not_measured_makes_every_verdict_unknown():
    skipped = [{"collective": "allreduce", "bytes": 124238336, "why": "--max-seconds 150 reached"}]
    s = summary(_points(), skipped)["allreduce"]
    assert s["not_measured"] == ["124238336 B not measured (--max-seconds 150 reached)"]
    assert {x["state"] for x in s["verdicts"]} == {"unknown"}
    only = summary([], skipped)["allreduce"]          # nothing measured at all: still a row, unknown
    assert only["sizes"] == [] and {x["state"] for x in only["verdicts"]} == {"unknown"}
    assert all("not measured (--max-seconds 150 reached)" in x["why"] for x in only["verdicts"])


def test_record_holds_no_nan_and_renders(tmp_path):
    from reports.tables import render

    assert finite_or_none(float("nan")) is None and finite_or_none(0.5) == 0.5
    best = NcclBest("r/nccl_tune.json", "2 x NVIDIA H100", 22809, 64, "/p.so", ("allreduce",), (1024,), ())
    r = EvaluateRecord("2026-11-27", "python -m autotune schedule evaluate r/", "abc", "NVIDIA H100", 2, "float32",
                       "r/schedule.json", {"sha256": "e" * 64}, {"allreduce": "k"}, 15, points=_points(),
                       nccl_run=best.to_dict(),
                       skipped=[{"collective": "allreduce", "bytes": 124238336, "why": "--max-seconds 150 reached"}])
    r.save(tmp_path / "schedule_evaluate.json")
    assert json.loads((tmp_path / "schedule_evaluate.json").read_text())["points"][0]["arms"][5]["max_rel_err"] is None
    again = EvaluateRecord.load(tmp_path / "schedule_evaluate.json")
    assert again.points[0].nccl_best == "ring/ll/auto with NCCL_MIN_CTAS=64" and again.skipped == r.skipped
    text = render(tmp_path / "schedule_evaluate.json")
    assert "| NCCL / tuned | NCCL best / tuned | NCCL best ran |" in text
    assert "| 1.500 | 1.250 | ring/ll/auto with NCCL_MIN_CTAS=64 |" in text
    assert "- allreduce 124238336 B: not measured (--max-seconds 150 reached)" in text
    assert "the table of r/nccl_tune.json (2 x NVIDIA H100, NCCL 22809)" in text
    assert "each knob's share protocol 1.500x (2/2 sizes), max_split -x (0/2 sizes)" in text
    assert "tuned >= 0.98x NCCL's best setting at every held-out size unknown" in text
