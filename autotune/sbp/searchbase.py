"""What every search shares: its budget, its result, its clock and its interface (``autotune.sbp.search``
holds the algorithms and their registry)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from calibrate.errors import OptionError

from autotune.sbp.cost import Problem


@dataclass(frozen=True)
class Budget:
    """What stops a search: seconds, steps, and ``patience``: restarts in a row that find nothing cheaper
    (convergence; coordinate descent only). Any one that runs out stops it."""

    seconds: float | None = None
    steps: int | None = None
    patience: int | None = None

    def __post_init__(self):
        if any(v is not None and not (0 < v < math.inf) for v in (self.seconds, self.steps, self.patience)):
            raise OptionError("budget", "must be a positive, finite number: give seconds (e.g. 10) or steps (e.g. 2000steps)")

    def describe(self) -> str:
        parts = [f"{self.seconds:.3g} s" if self.seconds else "", f"{self.steps} steps" if self.steps else "",
                 f"or {self.patience} restarts without improvement" if self.patience else ""]
        return " ".join(p for p in parts if p) or "none"


@dataclass
class SearchResult:
    algorithm: str
    assignment: list[int]
    cost: float
    seconds: float
    steps: int
    stopped: str
    trace: list[tuple[float, float]] = field(default_factory=list)
    bound: float = -math.inf  # a lower bound on the optimum, where the search proves one


class Clock:
    """Budget, best cost so far and its trace; with ``progress``, a line about once a second: the current
    best and the search rate."""

    EVERY = 1.0

    def __init__(self, budget: Budget, progress=None, name: str = ""):
        self.budget, self.t0, self.steps = budget, time.process_time(), 0
        self.trace: list[tuple[float, float]] = []
        self.best = math.inf
        self.bound = -math.inf  # a lower bound on the optimum, where the search has one
        self.progress, self.name, self._next = progress, name, self.EVERY

    def elapsed(self) -> float:
        """CPU seconds of this process since the start: the wall time on an idle core, and the same
        search on a shared machine, which would cut a wall-clock budget short."""
        return time.process_time() - self.t0

    def out(self) -> str | None:
        if self.progress is not None:
            t = self.elapsed()
            if t >= self._next:
                self._next = t + self.EVERY
                gap = (f", {self.best / self.bound - 1:.2%} above the lower bound {self.bound:.4g}"
                       if self.bound > 0 and math.isfinite(self.best) else "")
                self.progress(f"  {self.name}: {t:.1f} s, best {self.best:.4g} s/step{gap}, {self.steps} steps "
                              f"({self.steps / t:.0f}/s)")
        if self.budget.steps is not None and self.steps >= self.budget.steps:
            return f"step budget ({self.budget.steps} steps)"
        if self.budget.seconds is not None and self.elapsed() >= self.budget.seconds:
            return f"time budget ({self.budget.seconds:g} s)"
        return None

    def offer(self, cost: float) -> bool:
        if cost < self.best:
            self.best = cost
            self.trace.append((self.elapsed(), cost))
            return True
        return False


def require_additive(problem: Problem, name: str) -> None:
    if problem.objective != "comm":
        raise OptionError("search", f"{name} sums per-layer costs, which the step objective's overlap is not: "
                          "use {objective} comm, or {search} cd or mh")


class Search:
    name = ""
    progress = None  # a callable taking one line, for long searches

    def run(self, problem: Problem, budget: Budget, rng: np.random.Generator,
            start: list[int] | None = None) -> SearchResult:
        """``start``: an optional first plan (e.g. the best baseline) for the local searches."""
        raise NotImplementedError

    def _result(self, clock: Clock, best: list[int], stopped: str) -> SearchResult:
        return SearchResult(self.name, list(best), clock.best, clock.elapsed(), clock.steps, stopped, clock.trace)
