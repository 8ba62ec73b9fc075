"""The resharding plan: an executable format owned by the executor (as the GC3 IR is
owned by ``kernels.gc3``). A planner (``autotune.reshard``) writes it; the executor
(``kernels.reshard.program``) runs it on every rank.

A plan holds the task, its unit tasks and, in execution order, every job: the
unit task it moves, the strategy (a name of ``kernels.reshard.strategies.STRATEGIES``),
the sender, the receivers, the broadcast's partitions, and the planner's start
time and duration (seconds, predicted).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from calibrate.records import Record
from kernels.reshard.tasks import ReshardTask, UnitTask


@dataclass(frozen=True)
class PlannedJob:
    task: int
    strategy: str
    sender: int
    receivers: tuple[int, ...]
    partitions: int
    start: float
    duration: float
    nbytes: int

    @property
    def local(self) -> bool:
        """Its sender is its only receiver: the executor copies the unit from the source tile to the destination."""
        return tuple(self.receivers) == (self.sender,)


@dataclass
class Plan(Record):
    KIND = "commtune.reshard.plan"
    VERSION = 1
    WHAT = "resharding plan"
    FIX = "write one with python -m autotune reshard"

    task: ReshardTask
    profile: str
    strategy: str
    solver: str
    units: list[UnitTask]
    jobs: list[PlannedJob]          # in execution order (by start time)
    makespan: float
    lower_bound: float
    port_load: float

    def body(self) -> dict:
        return {"task": self.task.to_dict(), "profile": self.profile,
                "strategy": self.strategy, "solver": self.solver,
                "units": [u.to_dict() for u in self.units],
                "jobs": [dict(asdict(j), receivers=list(j.receivers)) for j in self.jobs],
                "makespan": self.makespan, "lower_bound": self.lower_bound, "port_load": self.port_load}

    @classmethod
    def from_body(cls, d: dict, origin: str) -> "Plan":
        jobs = [PlannedJob(**dict(j, receivers=tuple(j["receivers"]))) for j in d["jobs"]]
        return cls(ReshardTask.from_dict(d["task"]), d["profile"], d["strategy"], d["solver"],
                   [UnitTask.from_dict(u) for u in d["units"]], jobs, d["makespan"], d["lower_bound"],
                   d["port_load"])
