"""Confirmatory evaluation of a schedule tuning run (``python -m autotune schedule evaluate``).

Development (``python -m autotune schedule``) chooses per band from the measured
candidates: its own figures are the best of N candidates against NCCL measured beside
them, at the sizes it chose on, so they say more than was measured. Evaluation, in a
fresh process, at the sizes the run declared held out before measuring anything (hash
checked), compares as arms of one engine comparison per size (``kernels.interp.bench.
compare_choices``): the tuned manifest through the interpreter's own selection (what a
user gets), NCCL, and the development run's best fixed configuration (one candidate at
every size); each checked before and after its timed replays, medians. Each knob in which
the tuned choice differs from the fixed configuration gets an ablation arm, the tuned
candidate with that one knob as the fixed configuration has it (``knob_arms``), so that the
record says what each chosen knob is worth: its share, the ablation's time over the
tuned one. Its record (kind ``commtune.schedule-evaluate``) is the one to quote.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

from calibrate.errors import UserError
from calibrate.measure import stats
from calibrate.measure.verdict import judge
from calibrate.records import Record

TUNED, NCCL = "tuned", "nccl"
# the knobs of a candidate (autotune.schedule.space.Candidate); "algorithm" carries its source
KNOBS = ("algorithm", "channels", "instances", "protocol", "bytes_per_block", "max_split", "tile_bytes")
ABLATION = "tuned, {} as fixed"


def knob_arms(tuned, fixed, by_key: dict) -> dict[str, object]:
    """{arm name: the candidate's ``Built``, or why there is none} for each knob in which ``tuned``
    differs from ``fixed`` (Candidates): ``tuned`` with that knob set as ``fixed`` has it."""
    import dataclasses

    out: dict[str, object] = {}
    for knob in KNOBS:
        if getattr(tuned, knob) == getattr(fixed, knob):
            continue
        change = {knob: getattr(fixed, knob)} | ({"source": fixed.source} if knob == "algorithm" else {})
        variant = dataclasses.replace(tuned, **change)
        out[ABLATION.format(knob)] = by_key.get(variant.key) or \
            f"{variant.key} is not in the search space (the knob does not combine with the others)"
    return out


@dataclass
class Point:
    collective: str
    bytes: int
    tuned_choice: str                # what the tuned manifest's selection ran ("nccl": its fallback)
    arms: list[dict]                 # engine.ArmResult.to_dict per arm, and "max_rel_err"

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

    def body(self) -> dict:
        return asdict(self)

    @classmethod
    def from_body(cls, d: dict, origin: str) -> "EvaluateRecord":
        return cls.from_fields(d, origin, points=Point)


def summary(points: list[Point]) -> dict:
    """Per collective: NCCL / tuned and fixed / tuned (geometric mean and worst over the held-out sizes,
    medians each) and the verdicts: the tuned table at least as fast as NCCL at every size (within 2%)
    and faster than the best fixed configuration on geometric mean; unknown where an arm is missing."""
    out = {}
    for coll in dict.fromkeys(p.collective for p in points):
        mine = [p for p in points if p.collective == coll]
        fixed = next((a["name"] for p in mine for a in p.arms if a["name"].startswith("fixed ")), None)
        s: dict = {"sizes": [p.bytes for p in mine], "fixed": fixed}
        for base in (NCCL, fixed):
            if base is None:
                continue
            key = "nccl" if base == NCCL else "fixed"
            xs = [stats.ratio(p.median_us(base), p.median_us(TUNED)) for p in mine]
            missing = [w for p in mine for w in (p.why_missing(base), p.why_missing(TUNED)) if w]
            have = [x for x in xs if x is not None]
            s[f"over_{key}_geomean"] = stats.geomean(have) if have else None
            s[f"over_{key}_min"] = min(have) if have else None
            s[f"missing_{key}"] = missing
        v = [judge("tuned >= 0.98x NCCL at every held-out size", s.get("over_nccl_min"), lambda x: x >= 1 / 1.02,
                   s.get("missing_nccl", [])),
             judge("tuned faster than the best fixed configuration (geomean)", s.get("over_fixed_geomean"),
                   lambda x: x > 1.0, s.get("missing_fixed", ["fixed: no best fixed configuration recorded"]))]
        wrong = sum(max(a.get("wrong_before", -1), 0) + max(a.get("wrong_after", -1), 0) for p in mine
                    for a in p.arms)
        v.append(judge("wrong_0", float(wrong), lambda x: x == 0, fmt=".0f"))
        s["wrong"] = wrong
        knobs = {}
        for knob in KNOBS:
            name = ABLATION.format(knob)
            xs = [stats.ratio(p.median_us(name), p.median_us(TUNED)) for p in mine
                  if any(a["name"] == name for a in p.arms)]
            if xs:
                have = [x for x in xs if x is not None]
                knobs[knob] = {"share_geomean": stats.geomean(have) if have else None, "sizes": len(xs),
                               "timed": len(have)}
        s["knob_share"] = knobs       # the ablation's time over the tuned one: above 1, the knob is worth that
        s["verdicts"] = [x.to_dict() for x in v]
        out[coll] = s
    return out


def arms_for(comm, coll: str, count: int, dtype: str, tuned_loaded: list, others: dict) -> tuple[dict, str]:
    """({arm name: Choice, None for NCCL, or a UserError saying why the arm cannot run}, the tuned choice's
    label). ``others``: arm name -> [(entry, program)] of one candidate (the best fixed configuration,
    the knob ablations), or the reason it has none."""
    from kernels.interp.select import choose

    tuned = choose(tuned_loaded, coll, count, dtype, comm.nranks, comm.preset.max_split)
    arms: dict = {TUNED: tuned, NCCL: None}
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


def measure_point(comm, coll: str, nbytes: int, dtype: str, arms: dict, label: str, reps: int, stream) -> Point:
    from kernels.interp.bench import compare_choices

    res, errs = compare_choices(comm, coll, nbytes, dtype, arms, reps, stream, seed=nbytes % 65521)
    return Point(coll, nbytes, label, [a.to_dict() | {"max_rel_err": errs[a.name]} for a in res.arms.values()])

