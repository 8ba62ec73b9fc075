"""The record of one ``python -m autotune nccl`` run (``nccl_tune.json``, kind
``commtune.nccl-tune``): every measured setting per collective and size, the chosen table,
and NCCL default against NCCL tuned, re-measured in the same run; and the env file a job
script sources."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from calibrate.errors import UserError
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
    default_us: float
    tuned_us: float
    default_wrong: int
    tuned_wrong: int
    default_runs: str = ""  # algorithm/protocol NCCL ran by default
    tuned_runs: str = ""    # and with the table

    @property
    def ratio(self) -> float:
        """default / tuned: above 1 where the plugin makes NCCL faster."""
        return self.default_us / self.tuned_us


@dataclass
class TuneRecord(Record):
    KIND: ClassVar[str] = "commtune.nccl-tune"
    VERSION: ClassVar[int] = 1
    WHAT: ClassVar[str] = "NCCL tuning record"
    FIX: ClassVar[str] = "write one with python -m autotune nccl"

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
    table: str = ""
    env_file: str = ""
    sweep: list[Sample] = field(default_factory=list)
    pruned: list[dict] = field(default_factory=list)      # {collective, setting, bytes, why}: not measured
    not_applied: list[str] = field(default_factory=list)  # settings NCCL ruled out: never chosen
    table_rows: list[str] = field(default_factory=list)
    compare: list[Compare] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    plugin_counters: dict = field(default_factory=dict)

    def body(self) -> dict:
        return asdict(self)

    @classmethod
    def from_body(cls, d: dict, origin: str) -> "TuneRecord":
        body = {k: v for k, v in d.items() if k not in ("kind", "version")}
        try:
            body["sweep"] = [Sample(**s) for s in body.get("sweep", [])]
            body["compare"] = [Compare(**c) for c in body.get("compare", [])]
            return cls(**body)
        except TypeError as e:
            raise UserError(f"{origin}: malformed {cls.WHAT} ({e}): {cls.FIX}") from None


def summary(rows: list[Compare]) -> dict:
    """Per collective: geometric mean, worst and best ratio, ratio at the largest size, #wrong, targets met."""
    out = {}
    for coll in dict.fromkeys(r.collective for r in rows):
        mine = sorted((r for r in rows if r.collective == coll), key=lambda r: r.bytes)
        ratios = [r.ratio for r in mine]
        worst = min(mine, key=lambda r: r.ratio)
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        wrong = sum(max(r.default_wrong, 0) + max(r.tuned_wrong, 0) for r in mine)
        big = mine[-1]
        targets = {"never_slower_2pct": worst.ratio >= 1 / WORST_SLOWDOWN, "geomean_1.05": geo >= GEOMEAN_TARGET,
                   "wrong_0": wrong == 0}
        if coll in BIG_TARGET:
            targets[f"largest_{BIG_TARGET[coll]}"] = big.ratio >= BIG_TARGET[coll]
        out[coll] = {"geomean": geo, "worst": worst.ratio, "worst_bytes": worst.bytes, "best": max(ratios),
                     "largest_bytes": big.bytes, "largest_ratio": big.ratio, "wrong": wrong, "targets": targets}
    return out


def env_text(plugin: str | Path, table: str | Path, min_ctas: int, header: str) -> str:
    """The env file: ``source`` it in a job script to run NCCL as tuned."""
    return (f"# {header}\n# source this file in the job script, before the program that creates NCCL communicators\n"
            f"export NCCL_TUNER_PLUGIN={Path(plugin).resolve()}\n"
            f"export {ENV_TABLE}={Path(table).resolve()}\n"
            f"# the table was measured on communicators of at least {min_ctas} channels\n"
            f"export NCCL_MIN_CTAS={min_ctas}\n")
