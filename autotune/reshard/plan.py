"""Planning a resharding: the jobs of a strategy ordered by a solver, as a
``kernels.reshard.plan.Plan`` (the format the executor runs), plus the table of
all strategies x solvers."""
from __future__ import annotations

from autotune.reshard.network import Network
from autotune.reshard.solvers import SOLVERS, SolverConfig, lower_bound, makespan, port_load, simulate
from autotune.reshard.strategies import STRATEGIES, Job
from calibrate.errors import UserError
from calibrate.profile import Profile
from kernels.reshard.plan import Plan, PlannedJob
from kernels.reshard.tasks import ReshardTask, UnitTask, unit_tasks


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
