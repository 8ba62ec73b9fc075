"""The records of ``python -m autotune nccl``: the development run (``nccl_tune.json``, kind
``commtune.nccl-tune``: the held-out sizes declared before anything was measured, every
measured setting per collective and size, the chosen table, and the arms compared in the
same run) and the confirmatory evaluation (``nccl_evaluate.json``, kind
``commtune.nccl-evaluate``: the arms re-measured in a fresh process at the held-out sizes,
the only figures to quote); the summary of either, with each part of the gain attributed;
and the env file a job script sources."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from calibrate.measure import stats
from calibrate.measure.engine import Comparison
from calibrate.measure.verdict import judge
from calibrate.records import Record
from kernels.nccl_tuner.table import ENV_TABLE

# the targets (2 GPUs, CUDA graphs)
WORST_SLOWDOWN = 1.02        # never slower than the default by more than 2%
GEOMEAN_TARGET = 1.05
BIG_TARGET = {"allgather": 1.15, "reducescatter": 1.15}  # at the largest size (1 GiB)


@dataclass
class Sample:
    collective: str
    bytes: int
    setting: str            # Setting.label
    median_us: float
    samples_us: list[float]
    wrong: int              # wrong elements on fresh random data, summed over ranks; -1: not checked
    runs: str = ""          # algorithm/protocol NCCL ran, as the plugin saw it ("" unknown)


@dataclass
class Compare:
    collective: str
    bytes: int
    setting: str            # the table's setting for this size ("default" where no row applies)
    default_us: float | None    # None: the arm has no median (``arms`` says why)
    tuned_us: float | None
    default_wrong: int      # wrong elements before and after the timed calls; -1: not checked
    tuned_wrong: int
    default_runs: str = ""  # algorithm/protocol NCCL ran by default
    tuned_runs: str = ""    # and with the table
    arms: list[dict] = field(default_factory=list)   # every arm (engine.ArmResult.to_dict, and "runs")

    @property
    def ratio(self) -> float | None:
        """default / tuned: above 1 where the plugin makes NCCL faster; None where either is missing."""
        return stats.ratio(self.default_us, self.tuned_us)

    def arm_us(self, name: str) -> float | None:
        """An arm's median in microseconds (None: missing or not ok)."""
        a = next((a for a in self.arms if a["name"] == name), None)
        if a is None:
            return {"default": self.default_us, "tuned": self.tuned_us}.get(name)
        return None if a["status"] != "ok" or a["median_s"] is None else a["median_s"] * 1e6

    def why_missing(self, name: str) -> str:
        a = next((a for a in self.arms if a["name"] == name), None)
        if a is None:
            return "" if self.arm_us(name) is not None else f"{name}: not measured in this run"
        return "" if a["status"] == "ok" else f"{name} at {self.bytes} B: {a['status']} ({a['reason']})"

    @classmethod
    def from_comparison(cls, collective: str, nbytes: int, setting: str, res: Comparison,
                        runs: dict[str, str]) -> "Compare":
        def us(name):
            a = res.arms.get(name)
            return None if a is None or a.median_s is None else a.median_s * 1e6

        def wrong(name):
            a = res.arms.get(name)
            if a is None or a.wrong_before < 0:
                return -1
            return a.wrong_before + max(a.wrong_after, 0)

        arms = [a.to_dict() | {"runs": runs.get(a.name, "")} for a in res.arms.values()]
        return cls(collective, nbytes, setting, us("default"), us("tuned"), wrong("default"), wrong("tuned"),
                   runs.get("default", ""), runs.get("tuned", ""), arms)


@dataclass
class TuneRecord(Record):
    KIND: ClassVar[str] = "commtune.nccl-tune"
    VERSION: ClassVar[int] = 1
    WHAT: ClassVar[str] = "NCCL tuning record"
    FIX: ClassVar[str] = "write one with python -m autotune nccl"
    LISTS: ClassVar[dict] = {"sweep": Sample, "compare": Compare, "confirm": Sample}

    date: str
    command: str
    device: str
    nccl_version: int
    ranks: int
    nodes: int
    dtype: str
    mode: str
    iters: int
    reps: int
    min_ctas: int
    collectives: list[str]
    sizes: list[int]
    plugin: str
    rounds: int = 1         # interleaved rounds of default and tuned in the comparison
    heldout: dict = field(default_factory=dict)   # calibrate.measure.heldout.Declaration.to_dict, before the sweep
    fixed: dict = field(default_factory=dict)     # collective -> the best fixed setting of the sweep (label)
    table: str = ""
    env_file: str = ""
    sweep: list[Sample] = field(default_factory=list)
    pruned: list[dict] = field(default_factory=list)      # {collective, setting, bytes, why}: not measured
    not_applied: list[str] = field(default_factory=list)  # settings NCCL ruled out: never chosen
    table_rows: list[str] = field(default_factory=list)
    compare: list[Compare] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    plugin_counters: dict = field(default_factory=dict)
    confirm: list[Sample] = field(default_factory=list)   # the picks and the default at the confirmation sizes
    confirmations: list[str] = field(default_factory=list)  # per pick: its gain there, kept or dropped
    declined: list[str] = field(default_factory=list)       # collectives with no confirmed row (NCCL decides)


def summary(rows: list[Compare]) -> dict:
    """Per collective: default / tuned (geometric mean, worst, best, at the largest size), each other arm
    against NCCL's default (``against_default``: default / arm, geometric mean over the sizes where both
    ran: the floor alone, the table alone, the best fixed setting) and the tuned arm against each
    (``tuned_over``), #wrong over every arm, and the targets as verdicts: ``unknown`` (with why) where
    an arm they are judged over is missing at some size."""
    out = {}
    for coll in dict.fromkeys(r.collective for r in rows):
        mine = sorted((r for r in rows if r.collective == coll), key=lambda r: r.bytes)
        missing = [w for r in mine for w in (r.why_missing("default"), r.why_missing("tuned")) if w]
        have = [r for r in mine if r.ratio is not None]
        ratios = [r.ratio for r in have]
        wrong = sum(max(a.get("wrong_before", -1), 0) + max(a.get("wrong_after", -1), 0) for r in mine
                    for a in r.arms) if any(r.arms for r in mine) else \
            sum(max(r.default_wrong, 0) + max(r.tuned_wrong, 0) for r in mine)
        names = list(dict.fromkeys(a["name"] for r in mine for a in r.arms if a["name"] not in ("default", "tuned")))

        def geo(base, ours):
            xs = [stats.ratio(r.arm_us(base), r.arm_us(ours)) for r in mine]
            xs = [x for x in xs if x is not None]
            return stats.geomean(xs) if xs else None

        s = {"geomean": stats.geomean(ratios) if ratios else None, "points": len(mine), "timed": len(have),
             "missing": missing, "wrong": wrong,
             "against_default": {n: geo("default", n) for n in names},
             "tuned_over": {n: geo(n, "tuned") for n in names}}
        worst = min(have, key=lambda r: r.ratio) if have else None
        big = mine[-1]
        s |= {"worst": worst.ratio if worst else None, "worst_bytes": worst.bytes if worst else None,
              "best": max(ratios) if ratios else None, "largest_bytes": big.bytes, "largest_ratio": big.ratio}
        v = [judge("never_slower_2pct", s["worst"], lambda x: x >= 1 / WORST_SLOWDOWN, missing),
             judge("geomean_1.05", s["geomean"], lambda x: x >= GEOMEAN_TARGET, missing),
             judge("wrong_0", float(wrong), lambda x: x == 0, fmt=".0f")]
        if coll in BIG_TARGET:
            big_missing = [w for w in (big.why_missing("default"), big.why_missing("tuned")) if w]
            v.append(judge(f"largest_{BIG_TARGET[coll]}", big.ratio, lambda x: x >= BIG_TARGET[coll], big_missing))
        s["targets"] = {x.target: x.state for x in v}
        s["verdicts"] = [x.to_dict() for x in v]
        out[coll] = s
    return out


@dataclass
class EvaluateRecord(Record):
    """A confirmatory evaluation: the development record's table, its arms, at its held-out sizes, in
    a fresh process (``python -m autotune nccl evaluate``)."""
    KIND: ClassVar[str] = "commtune.nccl-evaluate"
    VERSION: ClassVar[int] = 1
    WHAT: ClassVar[str] = "NCCL tuner evaluation"
    FIX: ClassVar[str] = "write one with python -m autotune nccl evaluate"
    LISTS: ClassVar[dict] = {"compare": Compare}

    date: str
    command: str
    commit: str
    device: str
    nccl_version: int
    ranks: int
    nodes: int
    dtype: str
    min_ctas: int
    development: str                 # the development record evaluated
    heldout: dict                    # its declaration (hash checked)
    table_rows: list[str]
    fixed: dict
    rounds: int
    compare: list[Compare] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    basis: str = "evaluation"
    declined: dict = field(default_factory=dict)   # collective -> why its table is declined at these sizes
    table: str = ""                  # the evaluated table (the rows of the collectives not declined)


def env_text(plugin: str | Path, table: str | Path, min_ctas: int | None, header: str) -> str:
    """The env file: ``source`` it in a job script to run NCCL as tuned (``min_ctas`` None: no
    NCCL_MIN_CTAS, the table alone)."""
    floor = ("# NCCL_MIN_CTAS left out: the table alone\n" if min_ctas is None else
             f"# the table was measured on communicators of at least {min_ctas} channels\n"
             f"export NCCL_MIN_CTAS={min_ctas}\n")
    return (f"# {header}\n# source this file in the job script, before the program that creates NCCL communicators\n"
            f"export NCCL_TUNER_PLUGIN={Path(plugin).resolve()}\n"
            f"export {ENV_TABLE}={Path(table).resolve()}\n" + floor)
