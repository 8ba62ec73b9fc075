"""Verdicts that cannot lie by omission: a target judged over arms that did not all run is
``unknown``, with the arms that are missing and why; it is never ``met`` on what remained."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

MET, NOT_MET, UNKNOWN = "met", "not met", "unknown"


@dataclass
class Verdict:
    target: str
    value: str          # the measured value, as text ("-" where unknown)
    state: str          # met | not met | unknown
    why: str = ""       # for unknown: what is missing

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return f"target {self.target}: {self.value} -> {self.state}" + (f" ({self.why})" if self.why else "")


def judge(target: str, value: float | None, met: Callable[[float], bool], missing: Sequence[str] = (),
          fmt: str = ".3f") -> Verdict:
    """``met(value)`` decides, unless an arm the target is judged over is missing or there is no value."""
    if missing:
        return Verdict(target, "-" if value is None else format(value, fmt), UNKNOWN, "; ".join(missing))
    if value is None:
        return Verdict(target, "-", UNKNOWN, "no value")
    return Verdict(target, format(value, fmt), MET if met(value) else NOT_MET)


def overall(verdicts: Sequence[Verdict]) -> str:
    """met when every verdict is met, not met when any is not met, else unknown."""
    states = {v.state for v in verdicts}
    if NOT_MET in states:
        return NOT_MET
    return MET if states == {MET} else UNKNOWN
