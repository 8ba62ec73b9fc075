"""The one measurement engine: a comparison of named arms, interleaved in rounds.

An arm is one side of an A/B (ours, NCCL's default, NCCL's best setting, an ablation,
a peer), built on every rank of a group by a factory. ``compare`` runs them all the
same way:

1. start: each arm's factory runs on every rank; an arm that fails on any rank is a
   row ``failed`` with the reason, never silently absent;
2. check before: one call on fresh random data (output poisoned by the arm), wrong
   elements summed over ranks; a wrong arm is a row ``wrong`` and is not timed;
3. warm-up calls, then the calls per batch: at least ``calls`` and, in host and graph
   modes, the power of two that makes a batch last ``min_batch_s`` (from a probe batch,
   the slowest rank's), the same on every rank;
4. rounds: in round r the arms go in turn starting from arm r (so each goes first as
   often as the others); before each batch the arm's work is synchronized and the ranks
   meet at a barrier. A batch is captured three ways (``TimingMode``): ``host``, back to
   back calls timed by the host clock with one synchronization; ``graph``, the calls
   captured once in a CUDA graph and each replay timed by events; ``isolated``, barrier,
   one call, synchronization, per call. A sample is seconds per call, the maximum over
   ranks (a collective is as slow as its slowest rank);
5. check after: after every timed call, one more call on new fresh random data, so that
   state the timed calls reuse (FIFO credits, LL flags, a graph's buffers) is checked too.

Every step that can fail on one rank agrees over ranks first (``Group.agree``), so a
failure is one row and no rank is left waiting.
"""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from calibrate.errors import OptionError
from calibrate.measure import stats
from calibrate.registry import NamedEnum

PROBE_CALLS = 4         # calls of the probe batch that sets the batch length
MAX_CALLS = 4096        # most calls per batch


class TimingMode(NamedEnum):
    __what__ = "timing mode"

    HOST = "host"
    GRAPH = "graph"
    ISOLATED = "isolated"


class Status(NamedEnum):
    __what__ = "arm status"

    OK = "ok"            # started, correct before and after, timed
    FAILED = "failed"    # did not start (on some rank): not timed
    WRONG = "wrong"      # a wrong result before (not timed) or after the timed calls
    ERROR = "error"      # raised while being checked or prepared for timing


# -- the ranks ------------------------------------------------------------------------------
class Group(ABC):
    """The ranks that run a comparison together."""

    rank = 0
    size = 1

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def max(self, local: np.ndarray) -> np.ndarray:
        """Elementwise maximum over ranks."""

    @abstractmethod
    def sum(self, value: int) -> int: ...

    @abstractmethod
    def gather(self, value) -> list:
        """Every rank's ``value``, in rank order, on every rank."""

    def agree(self, fn: Callable[[], object]) -> tuple[object, str]:
        """(``fn()``'s value on this rank, "") when it returned on every rank, else (None, the first
        rank's error as "rank r: Type: message")."""
        try:
            value, err = fn(), ""
        except Exception as e:  # noqa: BLE001  (one rank's failure becomes every rank's row)
            value, err = None, f"{type(e).__name__}: {e}"[:300]
        errors = self.gather(err)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            return None, (bad[0][1] if self.size == 1 else f"rank {bad[0][0]}: {bad[0][1]}")
        return value, ""


class Solo(Group):
    """One process."""

    def barrier(self) -> None:
        pass

    def max(self, local: np.ndarray) -> np.ndarray:
        return np.asarray(local, dtype=float)

    def sum(self, value: int) -> int:
        return int(value)

    def gather(self, value) -> list:
        return [value]


class MpiGroup(Group):
    """The ranks of an mpi4py communicator; with ``start``, a wider communicator whose ranks run other
    groups' comparisons at the same time, every batch starts at a barrier over it (groups measured at
    once start together, as the steps of a training job do, instead of drifting apart)."""

    def __init__(self, comm, start=None):
        self.comm, self.start = comm, start if start is not None else comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def barrier(self) -> None:
        self.start.Barrier()

    def max(self, local: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        local = np.ascontiguousarray(local, dtype=float)
        out = np.empty_like(local)
        self.comm.Allreduce(local, out, op=MPI.MAX)
        return out

    def sum(self, value: int) -> int:
        from mpi4py import MPI

        return int(self.comm.allreduce(int(value), op=MPI.SUM))

    def gather(self, value) -> list:
        return self.comm.allgather(value)


class TorchGroup(Group):
    """The ranks of a torch.distributed process group (``group`` None: the default one); the
    reductions run on ``device`` (a CUDA device under NCCL, the CPU under gloo)."""

    def __init__(self, device, group=None):
        import torch.distributed as dist

        self.dist, self.device, self.group = dist, device, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def _reduce(self, local: np.ndarray, dtype, op) -> np.ndarray:
        import torch

        t = torch.as_tensor(np.ascontiguousarray(local), dtype=dtype).to(self.device)
        self.dist.all_reduce(t, op=op, group=self.group)
        return t.cpu().numpy()

    def max(self, local: np.ndarray) -> np.ndarray:
        import torch

        return self._reduce(np.asarray(local, dtype=float), torch.float64, self.dist.ReduceOp.MAX).astype(float)

    def sum(self, value: int) -> int:
        import torch

        return int(self._reduce(np.asarray([int(value)], dtype=np.int64), torch.int64, self.dist.ReduceOp.SUM)[0])

    def gather(self, value) -> list:
        out = [None] * self.size
        self.dist.all_gather_object(out, value, group=self.group)
        return out


# -- an arm ---------------------------------------------------------------------------------
class Arm(ABC):
    """One side of a comparison on this rank: a call, its check, its timers."""

    @abstractmethod
    def call(self) -> None:
        """One launch on the arm's buffers (may return before the work is done)."""

    def synchronize(self) -> None:
        """Wait for launched work (nothing to wait for on the host)."""

    def check(self, seed: int) -> int:
        """Fresh random input from ``seed`` (different on each rank, the same for a seed), the output
        poisoned, one call: the elements of this rank's output that are wrong. An arm without a
        check (a calibration's timing of work whose output nothing reads) runs with ``check`` off."""
        raise OptionError("check", "this arm has no check: compare it with Options(check=False)")

    def graph(self, calls: int) -> Callable[[], float]:
        """``calls`` calls captured once; the function replays them and returns the seconds the
        replay took on the device."""
        raise OptionError("mode", "graph: this arm has no graph capture; use host or isolated")

    def host(self, calls: int) -> Callable[[], float]:
        """Seconds of ``calls`` back-to-back calls and one synchronization, by the host clock."""
        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                self.call()
            self.synchronize()
            return time.perf_counter() - t0
        return run

    def close(self) -> None:
        """Release what the arm made (every rank together)."""


ArmFactory = Callable[[], Arm]


# -- options and results --------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    mode: TimingMode = TimingMode.HOST
    rounds: int = 5          # samples per arm (host, graph); rounds x calls per arm (isolated)
    calls: int = 20          # least calls per batch (isolated: timed calls per round)
    min_batch_s: float = 1e-3
    warmup: int = 3
    check: bool = True
    seed: int = 0

    def validated(self) -> "Options":
        mode = TimingMode.parse(self.mode) if isinstance(self.mode, str) else self.mode
        if self.rounds < 1:
            raise OptionError("rounds", f"must be at least 1, got {self.rounds}")
        if self.calls < 1:
            raise OptionError("calls", f"must be at least 1, got {self.calls}")
        if self.warmup < 0:
            raise OptionError("warmup", f"must be at least 0, got {self.warmup}")
        if not (self.min_batch_s >= 0 and math.isfinite(self.min_batch_s)):
            raise OptionError("min_batch_s", f"must be a finite number of seconds >= 0, got {self.min_batch_s}")
        return Options(mode, self.rounds, self.calls, self.min_batch_s, self.warmup, self.check, self.seed)

    def describe(self) -> str:
        batch = (f"{self.calls} call(s) per round, each timed alone after a barrier" if self.mode is TimingMode.ISOLATED
                 else f"batches of at least {self.calls} calls and {self.min_batch_s * 1e3:g} ms")
        how = {TimingMode.HOST: "host loops", TimingMode.GRAPH: "CUDA graphs, events",
               TimingMode.ISOLATED: "isolated calls"}[self.mode]
        checked = "checked on fresh random data before and after the timed calls" if self.check else "not checked"
        return (f"{how}; {batch}; {self.rounds} interleaved rounds (each arm first in turn); barrier before each "
                f"batch; maximum over ranks; median; {checked}")


@dataclass
class ArmResult:
    name: str
    status: Status
    reason: str = ""                 # why not ok
    calls: int = 0                   # calls per batch
    samples_s: list[float] = field(default_factory=list)   # seconds per call, maximum over ranks
    wrong_before: int = -1           # wrong elements summed over ranks; -1: not checked
    wrong_after: int = -1

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def timed(self) -> bool:
        return bool(self.samples_s)

    @property
    def median_s(self) -> float | None:
        return stats.median(self.samples_s) if self.ok and self.samples_s else None

    @property
    def ci_s(self) -> tuple[float, float]:
        return stats.median_ci(self.samples_s) if self.samples_s else (math.nan, math.nan)

    def to_dict(self) -> dict:
        lo, hi = self.ci_s
        return {"name": self.name, "status": self.status.value, "reason": self.reason, "calls": self.calls,
                "median_s": self.median_s, "ci_lo_s": None if math.isnan(lo) else lo,
                "ci_hi_s": None if math.isnan(hi) else hi, "samples_s": list(self.samples_s),
                "wrong_before": self.wrong_before, "wrong_after": self.wrong_after}

    @classmethod
    def from_dict(cls, d: dict) -> "ArmResult":
        return cls(d["name"], Status.parse(d["status"]), d.get("reason", ""), int(d.get("calls", 0)),
                   [float(x) for x in d.get("samples_s", [])], int(d.get("wrong_before", -1)),
                   int(d.get("wrong_after", -1)))


@dataclass
class Comparison:
    arms: dict[str, ArmResult]
    options: Options
    order: list[list[str]] = field(default_factory=list)   # the arms' order in each round

    def __getitem__(self, name: str) -> ArmResult:
        return self.arms[name]

    def ratio(self, base: str, ours: str) -> float | None:
        """``base``'s median over ``ours``' (above 1: ours is faster); None where either is not ok."""
        b, o = self.arms.get(base), self.arms.get(ours)
        if b is None or o is None:
            return None
        return stats.ratio(b.median_s, o.median_s)

    def missing(self, names: Sequence[str]) -> list[str]:
        """"name: why" for each of ``names`` that has no median."""
        out = []
        for n in names:
            a = self.arms.get(n)
            if a is None:
                out.append(f"{n}: not in the comparison")
            elif not a.ok:
                out.append(f"{n}: {a.status.value}" + (f" ({a.reason})" if a.reason else ""))
        return out

    def to_dict(self) -> dict:
        o = self.options
        return {"timing": o.describe(), "mode": o.mode.value, "rounds": o.rounds, "min_batch_s": o.min_batch_s,
                "checked": o.check, "order": self.order, "arms": [a.to_dict() for a in self.arms.values()]}

    @classmethod
    def from_dict(cls, d: dict) -> "Comparison":
        arms = [ArmResult.from_dict(a) for a in d["arms"]]
        opts = Options(TimingMode.parse(d["mode"]), int(d["rounds"]), min_batch_s=float(d["min_batch_s"]),
                       check=bool(d["checked"]))
        return cls({a.name: a for a in arms}, opts, [list(r) for r in d.get("order", [])])


# -- the engine -----------------------------------------------------------------------------
def batch_calls(per_call_s: float, least: int, min_batch_s: float) -> int:
    """``least``, or the power of two of calls that lasts at least ``min_batch_s``, whichever is more
    (at most ``MAX_CALLS``). A batch starts when the ranks leave a barrier, a few microseconds apart:
    spread over a millisecond of calls that skew is a fraction of a percent of the sample."""
    if per_call_s <= 0 or per_call_s * least >= min_batch_s:
        return least
    need = min_batch_s / per_call_s
    return int(min(max(least, 2 ** math.ceil(math.log2(need))), MAX_CALLS))


def _start(group: Group, name: str, make: ArmFactory) -> tuple[Arm | None, str]:
    arm, err = group.agree(make)
    return arm, err


def compare(group: Group, arms: Sequence[tuple[str, ArmFactory]], options: Options = Options()) -> Comparison:
    """Every arm started, checked, timed in interleaved rounds and checked again (module docstring)."""
    o = options.validated()
    names = [n for n, _ in arms]
    if len(set(names)) != len(names):
        raise OptionError("arms", f"names must differ: {names}")
    results: dict[str, ArmResult] = {}
    live: dict[str, Arm] = {}
    try:
        for name, make in arms:
            arm, err = _start(group, name, make)
            if err:
                results[name] = ArmResult(name, Status.FAILED, f"did not start: {err}")
            else:
                live[name] = arm
                results[name] = ArmResult(name, Status.OK)
        timers = _prepare(group, live, results, o)
        order = _rounds(group, live, timers, results, o)
        if o.check:
            for name, arm in live.items():
                if name in timers:
                    _check(group, name, arm, results[name], o.seed * 2 + 2, after=True)
        return Comparison({n: results[n] for n in names}, o, order)
    finally:
        for arm in live.values():
            arm.close()


def _check(group: Group, name: str, arm: Arm, res: ArmResult, seed: int, after: bool) -> bool:
    when = "after the timed calls" if after else "before timing"
    wrong, err = group.agree(lambda: int(arm.check(seed)))
    if err:
        res.status, res.reason = Status.ERROR, f"check {when}: {err}"
        return False
    total = group.sum(wrong)
    if after:
        res.wrong_after = total
    else:
        res.wrong_before = total
    if total:
        res.status, res.reason = Status.WRONG, f"{total} wrong element(s) {when}"
    return not total


def _prepare(group: Group, live: dict[str, Arm], results: dict[str, ArmResult], o: Options) -> dict:
    """Check before, warm up, size the batch and build its timer: {name: timer} of the arms to time."""
    timers = {}
    for name, arm in live.items():
        res = results[name]
        if o.check and not _check(group, name, arm, res, o.seed * 2 + 1, after=False):
            continue

        def ready(arm=arm):
            for _ in range(o.warmup):
                arm.call()
            arm.synchronize()
            return arm.host(PROBE_CALLS)() / PROBE_CALLS

        probe, err = group.agree(ready)
        if err:
            res.status, res.reason = Status.ERROR, f"warm-up: {err}"
            continue
        calls = o.calls
        if o.mode is TimingMode.ISOLATED:
            calls = 1
        elif o.min_batch_s > 0:
            calls = batch_calls(float(group.max(np.asarray([probe]))[0]), o.calls, o.min_batch_s)
        timer, err = group.agree(lambda arm=arm, calls=calls: arm.graph(calls) if o.mode is TimingMode.GRAPH
                                 else arm.host(calls))
        if err:
            res.status, res.reason = Status.ERROR, f"{o.mode.value} capture: {err}"
            continue
        res.calls = calls
        timers[name] = (timer, calls)
    return timers


def _rounds(group: Group, live: dict[str, Arm], timers: dict, results: dict[str, ArmResult], o: Options) -> list:
    names = list(timers)
    local: dict[str, list[float]] = {n: [] for n in names}
    order = []
    per_round = o.calls if o.mode is TimingMode.ISOLATED else 1
    for r in range(o.rounds):
        turn = names[r % len(names):] + names[:r % len(names)] if names else []
        order.append(turn)
        for name in turn:
            timer, calls = timers[name]
            for _ in range(per_round):
                live[name].synchronize()
                group.barrier()
                local[name].append(timer() / calls)
    for name in names:
        results[name].samples_s = [float(x) for x in group.max(np.asarray(local[name], dtype=float))]
    return order
