"""Confirmatory evaluation of a schedule tuning run (``python -m autotune schedule evaluate``).

Development (``python -m autotune schedule``) chooses per band from the measured
candidates: its own figures are the best of N candidates against NCCL measured beside
them, at the sizes it chose on, so they say more than was measured. Evaluation, in a
fresh process, at the sizes the run declared held out before measuring anything (hash
checked), compares as arms of one engine comparison per size (``kernels.interp.bench.
compare_choices``): the tuned manifest through the interpreter's own selection (what a
user gets), NCCL, NCCL's best setting for that size as an NCCL tuning run's development
sweep chose it (``autotune.schedule.nccl_best``), and the development run's best fixed
configuration (one candidate at every size); each checked before and after its timed
replays, medians. Each knob in which the tuned choice differs from the fixed configuration
gets an ablation arm, the tuned candidate with that one knob as the fixed configuration has
it (``knob_arms``; built directly where the search space does not enumerate that
combination), so that the record says what each chosen knob is worth: its share, the
ablation's time over the tuned one. Its record (kind ``commtune.schedule-evaluate``) is the
one to quote.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

from calibrate.errors import UserError
from calibrate.measure import stats
from calibrate.measure.verdict import judge
from calibrate.records import Record

from autotune.schedule.space import Candidate, build_variant

TUNED, NCCL, NCCL_BEST = "tuned", "nccl", "nccl best"
# the knobs of a candidate (autotune.schedule.space.Candidate); "algorithm" carries its source
KNOBS = ("algorithm", "channels", "instances", "protocol", "bytes_per_block", "max_split", "tile_bytes")
FILE_FIXED = ("channels", "instances")      # what a program file fixes (its own channel count, one instance)
ABLATION = "tuned, {} as fixed"


def variant(tuned: Candidate, fixed: Candidate, knob: str) -> Candidate | str:
    """``tuned`` with ``knob`` as ``fixed`` has it, or why no candidate can be that."""
    if knob == "algorithm":
        change = {"algorithm": fixed.algorithm, "source": fixed.source}
        if fixed.source == "file":
            change |= {k: getattr(fixed, k) for k in FILE_FIXED}
        return dataclasses.replace(tuned, **change)
    if knob in FILE_FIXED and tuned.source == "file":
        return (f"the program file {tuned.algorithm} fixes its {knob} ({getattr(tuned, knob)}); it cannot take "
                f"{getattr(fixed, knob)}")
    return dataclasses.replace(tuned, **{knob: getattr(fixed, knob)})


def knob_arms(tuned: Candidate, fixed: Candidate, built: dict, collective: str, ranks: int,
              nodes: int = 1) -> dict[str, object]:
    """{arm name: the ``Built`` candidate, or why there is none} for each knob in which ``tuned`` differs
    from ``fixed``: ``tuned`` with that knob as ``fixed`` has it. A combination the search space does not
    enumerate is built directly (``space.build_variant``) and added to ``built`` (key -> Built), so that
    other sizes reuse it; only one the interpreter cannot run is a reason."""
    out: dict[str, object] = {}
    for knob in KNOBS:
        if getattr(tuned, knob) == getattr(fixed, knob):
            continue
        v = variant(tuned, fixed, knob)
        if not isinstance(v, str) and v.key not in built:
            try:
                built[v.key] = build_variant(v, collective, ranks, nodes)
            except UserError as e:
                v = str(e)
        out[ABLATION.format(knob)] = v if isinstance(v, str) else built[v.key]
    return out


@dataclass
class Point:
    collective: str
    bytes: int
    tuned_choice: str                # what the tuned manifest's selection ran ("nccl": its fallback)
    arms: list[dict]                 # engine.ArmResult.to_dict per arm, and "max_rel_err" (None: not run)
    nccl_best: str = ""              # the setting the NCCL-best arm ran at this size, or why it has none

    def median_us(self, name: str) -> float | None:
        a = next((a for a in self.arms if a["name"] == name), None)
        return None if a is None or a["status"] != "ok" or a["median_s"] is None else a["median_s"] * 1e6

    def why_missing(self, name: str) -> str:
        a = next((a for a in self.arms if a["name"] == name), None)
        if a is None:
            return f"{name} at {self.bytes} B: not an arm"
        return "" if a["status"] == "ok" else f"{name} at {self.bytes} B: {a['status']} ({a['reason']})"


@dataclass
class EvaluateRecord(Record):
    KIND: ClassVar[str] = "commtune.schedule-evaluate"
    VERSION: ClassVar[int] = 1
    WHAT: ClassVar[str] = "schedule tuner evaluation"
    FIX: ClassVar[str] = "write one with python -m autotune schedule evaluate"
    LISTS: ClassVar[dict] = {"points": Point}

    date: str
    command: str
    commit: str
    device: str
    ranks: int
    dtype: str
    development: str                 # the schedule.json evaluated
    heldout: dict                    # its declaration (hash checked)
    fixed: dict                      # collective -> the development run's best fixed candidate
    reps: int
    points: list[Point] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    basis: str = "evaluation"
    nccl_run: dict = field(default_factory=dict)   # where NCCL's best settings come from (nccl_best.NcclBest)
    skipped: list[dict] = field(default_factory=list)  # {collective, bytes, why}: held-out sizes not measured


def _over(mine: list[Point], base: str) -> tuple[float | None, float | None, list[str]]:
    """(geomean, worst) of ``base``'s median over the tuned one's at the sizes of ``mine``, and what is missing."""
    xs = [stats.ratio(p.median_us(base), p.median_us(TUNED)) for p in mine]
    missing = [w for p in mine for w in (p.why_missing(base), p.why_missing(TUNED)) if w]
    have = [x for x in xs if x is not None]
    return (stats.geomean(have) if have else None), (min(have) if have else None), missing


def summary(points: list[Point], skipped: list[dict] = ()) -> dict:
    """Per collective: NCCL / tuned, NCCL's best setting / tuned and fixed / tuned (geometric mean and worst
    over the held-out sizes, medians each) and the verdicts: the tuned table at least as fast as NCCL and as
    NCCL's best setting at every size (within 2%) and faster than the best fixed configuration on geometric
    mean; unknown where an arm is missing or a held-out size was not measured (``skipped``)."""
    out = {}
    for coll in dict.fromkeys([p.collective for p in points] + [k["collective"] for k in skipped]):
        mine = [p for p in points if p.collective == coll]
        unmeasured = [f"{k['bytes']} B not measured ({k['why']})" for k in skipped if k["collective"] == coll]
        fixed = next((a["name"] for p in mine for a in p.arms if a["name"].startswith("fixed ")), None)
        s: dict = {"sizes": [p.bytes for p in mine], "fixed": fixed, "not_measured": unmeasured}
        for key, base in (("nccl", NCCL), ("nccl_best", NCCL_BEST), ("fixed", fixed)):
            if base is None:
                s[f"over_{key}_geomean"] = s[f"over_{key}_min"] = None
                s[f"missing_{key}"] = ["fixed: no best fixed configuration recorded"] if mine else unmeasured
                continue
            geo, worst, missing = _over(mine, base)
            s[f"over_{key}_geomean"], s[f"over_{key}_min"], s[f"missing_{key}"] = geo, worst, missing + unmeasured
        v = [judge("tuned >= 0.98x NCCL at every held-out size", s["over_nccl_min"], lambda x: x >= 1 / 1.02,
                   s["missing_nccl"]),
             judge("tuned >= 0.98x NCCL's best setting at every held-out size", s["over_nccl_best_min"],
                   lambda x: x >= 1 / 1.02, s["missing_nccl_best"]),
             judge("tuned faster than the best fixed configuration (geomean)", s["over_fixed_geomean"],
                   lambda x: x > 1.0, s["missing_fixed"])]
        wrong = sum(max(a.get("wrong_before", -1), 0) + max(a.get("wrong_after", -1), 0) for p in mine
                    for a in p.arms)
        v.append(judge("wrong_0", float(wrong), lambda x: x == 0, unmeasured, fmt=".0f"))
        s["wrong"] = wrong
        knobs = {}
        for knob in KNOBS:
            name = ABLATION.format(knob)
            at = [p for p in mine if any(a["name"] == name for a in p.arms)]
            if at:
                geo, _, missing = _over(at, name)
                timed = sum(p.median_us(name) is not None and p.median_us(TUNED) is not None for p in at)
                knobs[knob] = {"share_geomean": geo, "sizes": len(at), "timed": timed, "missing": missing}
        s["knob_share"] = knobs       # the ablation's time over the tuned one: above 1, the knob is worth that
        s["verdicts"] = [x.to_dict() for x in v]
        out[coll] = s
    return out


def arms_for(comm, coll: str, count: int, dtype: str, tuned_loaded: list, others: dict,
             ready: dict | None = None) -> tuple[dict, str]:
    """({arm name: Choice, None for NCCL, an engine arm factory, or a UserError saying why the arm cannot
    run}, the tuned choice's label). ``ready``: arms taken as they are (NCCL's best setting: a factory of
    its arm, None for NCCL's default, or a UserError); ``others``: arm name -> [(entry, program)] of one
    candidate (the best fixed configuration, the knob ablations), or the reason it has none."""
    from kernels.interp.select import choose

    tuned = choose(tuned_loaded, coll, count, dtype, comm.nranks, comm.preset.max_split)
    arms: dict = {TUNED: tuned, NCCL: None} | dict(ready or {})
    for name, loaded in others.items():
        if isinstance(loaded, str):
            arms[name] = UserError(loaded)
            continue
        c = choose(loaded, coll, count, dtype, comm.nranks, comm.preset.max_split)
        arms[name] = UserError(f"the interpreter cannot run it here: {c.reason}") if c.uses_nccl else c
    return arms, "nccl" if tuned.uses_nccl else f"{tuned.program.name} ({tuned.protocol.value}, split {tuned.split})"


def covering(table, nbytes: int) -> str | None:
    """The candidate key of the tuned table entry serving ``nbytes`` (None: NCCL serves it)."""
    return next((t.choice for t in table if t.lo <= nbytes and (t.hi == 0 or nbytes < t.hi)), None)


def finite_or_none(x: float) -> float | None:
    """A record holds no NaN (an arm that did not run has no error): None instead."""
    return None if x is None or not math.isfinite(x) else float(x)


def measure_point(comm, coll: str, nbytes: int, dtype: str, arms: dict, label: str, reps: int, stream,
                  nccl_best: str = "") -> Point:
    from kernels.interp.bench import compare_choices

    res, errs = compare_choices(comm, coll, nbytes, dtype, arms, reps, stream, seed=nbytes % 65521)
    return Point(coll, nbytes, label, [a.to_dict() | {"max_rel_err": finite_or_none(errs[a.name])}
                                       for a in res.arms.values()], nccl_best)
