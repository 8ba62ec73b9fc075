"""Resharding plans: the chosen sender, strategy and start time of every job,
as versioned JSON that round-trips, plus the table of all strategies x solvers."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from autotune.reshard.network import Network
from autotune.reshard.solvers import SOLVERS, SolverConfig, lower_bound, makespan, port_load, simulate
from autotune.reshard.strategies import STRATEGIES, Job
from autotune.reshard.tasks import ReshardTask, UnitTask, unit_tasks
from calibrate.errors import UserError
from calibrate.jsonfile import read_json, write_json
from calibrate.profile import Profile

SCHEMA = "commtune.reshard.plan"
VERSION = 1


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


@dataclass
class Plan:
    task: ReshardTask
    profile: str
    strategy: str
    solver: str
    units: list[UnitTask]
    jobs: list[PlannedJob]          # in execution order (by start time)
    makespan: float
    lower_bound: float
    port_load: float

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "version": VERSION, "task": self.task.to_dict(), "profile": self.profile,
                "strategy": self.strategy, "solver": self.solver,
                "units": [u.to_dict() for u in self.units],
                "jobs": [dict(asdict(j), receivers=list(j.receivers)) for j in self.jobs],
                "makespan": self.makespan, "lower_bound": self.lower_bound, "port_load": self.port_load}

    @classmethod
    def from_dict(cls, d: dict, origin: str = "plan") -> "Plan":
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise UserError(f"{origin} is not a resharding plan (missing schema {SCHEMA!r}): "
                            f"write one with python -m autotune reshard ... --plan-out FILE")
        if d.get("version") != VERSION:
            raise UserError(f"{origin} has plan version {d.get('version')!r}, this tool reads {VERSION}: "
                            f"re-plan it with python -m autotune reshard")
        jobs = [PlannedJob(**dict(j, receivers=tuple(j["receivers"]))) for j in d["jobs"]]
        return cls(ReshardTask.from_dict(d["task"]), d["profile"], d["strategy"], d["solver"],
                   [UnitTask.from_dict(u) for u in d["units"]], jobs, d["makespan"], d["lower_bound"],
                   d["port_load"])

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict(), "plan file")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        data = read_json(path, "plan file", "write one with python -m autotune reshard --plan-out")
        return cls.from_dict(data, origin=f"plan file {str(path)!r}")


def _check_name(name: str, registry: dict, what: str) -> None:
    if name not in registry:
        raise UserError(f"unknown {what} {name!r}: choose one of {', '.join(registry)}")


def build_jobs(units: list[UnitTask], strategy: str, net: Network) -> list[Job]:
    _check_name(strategy, STRATEGIES, "strategy")
    impl = STRATEGIES[strategy]()
    return [job for u in units for job in impl.jobs(u, net)]


def make_plan(task: ReshardTask, profile: Profile, strategy: str = "broadcast", solver: str = "ensemble",
              cfg: SolverConfig = SolverConfig(), units: list[UnitTask] | None = None,
              bound: float | None = None) -> Plan:
    _check_name(solver, SOLVERS, "solver")
    net = Network(profile, task.devices_per_host)
    units = unit_tasks(task) if units is None else units
    jobs = build_jobs(units, strategy, net)
    order = SOLVERS[solver]().solve(jobs, cfg)
    slots = simulate(jobs, order)
    planned = sorted(
        (PlannedJob(jobs[s.job].task, strategy, jobs[s.job].options[s.option].sender, jobs[s.job].receivers,
                    jobs[s.job].options[s.option].partitions, s.start, s.end - s.start, jobs[s.job].nbytes)
         for s in slots),
        key=lambda pj: (pj.start, pj.task, pj.receivers))
    lb = lower_bound(units, net) if bound is None else bound
    return Plan(task, profile.name, strategy, solver, units, planned, makespan(slots), lb,
                port_load(jobs, order))


def compare(task: ReshardTask, profile: Profile, strategies, solvers, cfg: SolverConfig = SolverConfig(),
            progress=None) -> dict[tuple[str, str], Plan]:
    """Every strategy under every solver (sharing the unit tasks and the bound)."""
    units = unit_tasks(task)
    bound = lower_bound(units, Network(profile, task.devices_per_host))
    out = {}
    for st in strategies:
        for so in solvers:
            if progress:
                progress(f"planning {st} with {so}")
            out[(st, so)] = make_plan(task, profile, st, so, cfg, units, bound)
    return out
