"""Pipeline schedules (GPipe, 1F1B, eager-1F1B; §4) as per-stage orders of
compute tasks, and a simulator that overlaps inter-stage communication with
computation wherever the dependencies allow.

Model: each stage runs its compute tasks one at a time in the schedule's order.
F(s, m) needs the activation of micro-batch m from stage s-1; B(s, m) needs
F(s, m) and the gradient from stage s+1. Each boundary has one link per
direction that carries transfers one at a time, in the order their producers
finish; a transfer starts when its producer ends and the link is free, so it
overlaps with whatever the stages compute meanwhile.

Warm-up forwards before the first backward, stage s of S (0-indexed; the paper
counts from 1): 1F1B runs S - s (the paper's #stages - i + 1), eager-1F1B runs
2(S - s) - 1 (the paper's 2(#stages - i) + 1), GPipe runs all M.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources

from calibrate.errors import UserError

Task = tuple[str, int]  # ("F" | "B", micro-batch)


class Schedule:
    name = ""

    def warmup(self, stage: int, stages: int, micro_batches: int) -> int:
        raise NotImplementedError

    def orders(self, stages: int, micro_batches: int) -> list[list[Task]]:
        out = []
        for s in range(stages):
            w = min(max(self.warmup(s, stages, micro_batches), 1), micro_batches)
            order: list[Task] = [("F", m) for m in range(w)]
            for j in range(micro_batches - w):
                order += [("B", j), ("F", w + j)]
            order += [("B", m) for m in range(micro_batches - w, micro_batches)]
            out.append(order)
        return out


class GPipe(Schedule):
    name = "gpipe"

    def warmup(self, stage, stages, micro_batches):
        return micro_batches


class OneFOneB(Schedule):
    name = "1f1b"

    def warmup(self, stage, stages, micro_batches):
        return stages - stage


class EagerOneFOneB(Schedule):
    name = "eager_1f1b"

    def warmup(self, stage, stages, micro_batches):
        return 2 * (stages - stage) - 1


SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (GPipe, OneFOneB, EagerOneFOneB)}


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    micro_batches: int
    forward: tuple[float, ...]        # seconds per micro-batch, per stage
    backward: tuple[float, ...]
    comm_forward: tuple[float, ...]   # boundary s -> s+1, seconds per micro-batch
    comm_backward: tuple[float, ...]  # boundary s+1 -> s
    activation_bytes: tuple[float, ...]

    def __post_init__(self):
        s = len(self.forward)
        if s < 1 or self.micro_batches < 1:
            raise UserError(f"pipeline {self.name!r} needs at least one stage and one micro-batch")
        if len(self.backward) != s or len(self.activation_bytes) != s:
            raise UserError(f"pipeline {self.name!r}: give forward, backward and activation_bytes for all {s} stages")
        if len(self.comm_forward) != s - 1 or len(self.comm_backward) != s - 1:
            raise UserError(f"pipeline {self.name!r}: give {s - 1} communication times per direction (one per boundary)")

    @property
    def stages(self) -> int:
        return len(self.forward)


@dataclass(frozen=True)
class Interval:
    lane: str      # "stage 0" or "link 0>1" / "link 1>0"
    kind: str      # F, B, or C (communication)
    micro_batch: int
    start: float
    end: float


@dataclass
class PipelineResult:
    schedule: str
    makespan: float
    throughput: float                 # micro-batches per second
    peak_activations: list[int]       # per stage, in micro-batches
    peak_memory: list[float]          # per stage, bytes
    comm_time: float                  # all transfers, summed
    comm_wait: float                  # time consumers sat waiting for a transfer they were otherwise ready without
    intervals: list[Interval] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["intervals"] = [asdict(i) for i in self.intervals]
        return d


def simulate(spec: PipelineSpec, schedule: str, with_comm: bool = True) -> PipelineResult:
    if schedule not in SCHEDULES:
        raise UserError(f"unknown pipeline schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    S, M = spec.stages, spec.micro_batches
    orders = SCHEDULES[schedule]().orders(S, M)
    cf = spec.comm_forward if with_comm else (0.0,) * (S - 1)
    cb = spec.comm_backward if with_comm else (0.0,) * (S - 1)
    ptr, free = [0] * S, [0.0] * S
    link: dict[tuple[int, str], float] = {}
    arrival: dict[tuple[str, int, int], float] = {}
    sent: dict[tuple[str, int, int], float] = {}  # when the producer of each transfer finished
    fdone: dict[tuple[int, int], float] = {}
    held, peak = [0] * S, [0] * S
    events: list[tuple[float, int, int, int]] = []  # (time, order, stage, delta) for memory
    intervals: list[Interval] = []
    remaining = sum(len(o) for o in orders)
    wait = 0.0
    while remaining:
        progressed = False
        for s in range(S):
            while ptr[s] < len(orders[s]):
                kind, m = orders[s][ptr[s]]
                if kind == "F":
                    deps = [arrival.get(("F", s, m))] if s > 0 else []
                else:
                    deps = [fdone.get((s, m))] + ([arrival.get(("B", s, m))] if s < S - 1 else [])
                if any(d is None for d in deps):
                    break
                start = max([free[s], *deps])
                comm_dep = deps[-1] if (kind == "F" and s > 0) or (kind == "B" and s < S - 1) else None
                if comm_dep is not None:
                    latency = comm_dep - sent[(kind, s, m)]
                    wait += max(0.0, min(latency, comm_dep - max([free[s], *deps[:-1]])))
                end = start + (spec.forward[s] if kind == "F" else spec.backward[s])
                free[s] = end
                intervals.append(Interval(f"stage {s}", kind, m, start, end))
                if kind == "F":
                    fdone[(s, m)] = end
                    events.append((start, 1, s, +1))
                    if s < S - 1:
                        _send(link, arrival, sent, intervals, (s, "f"), end, cf[s], ("F", s + 1, m), f"link {s}>{s + 1}", m)
                else:
                    events.append((end, 0, s, -1))
                    if s > 0:
                        _send(link, arrival, sent, intervals, (s - 1, "b"), end, cb[s - 1], ("B", s - 1, m), f"link {s}>{s - 1}", m)
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise UserError(f"schedule {schedule!r} deadlocks on pipeline {spec.name!r}: its orders are inconsistent")
    for _, _, s, delta in sorted(events):
        held[s] += delta
        peak[s] = max(peak[s], held[s])
    ms = max(i.end for i in intervals)
    comm = M * (sum(cf) + sum(cb))
    return PipelineResult(schedule, ms, M / ms, peak, [p * a for p, a in zip(peak, spec.activation_bytes)],
                          comm, wait, intervals)


def _send(link, arrival, sent, intervals, key, ready, duration, target, lane, m):
    sent[target] = ready
    start = max(ready, link.get(key, 0.0))
    link[key] = start + duration
    arrival[target] = start + duration
    if duration > 0:
        intervals.append(Interval(lane, "C", m, start, start + duration))


def hidden_fraction(result: PipelineResult) -> float:
    """Share of the inter-stage communication hidden behind computation.

    A transfer is exposed for as long as its consumer waits for it after the
    consumer's stage and its other inputs are ready, at most its own latency
    (queueing plus transfer; the magnified micro-batch of the paper's Fig. 4);
    hidden = 1 - sum of those waits / sum of transfer times.
    """
    return 1.0 if result.comm_time <= 0 else 1.0 - result.comm_wait / result.comm_time


def exposed_time(spec: PipelineSpec, schedule: str) -> float:
    """How much communication lengthens the iteration: makespan with it minus without it."""
    return simulate(spec, schedule).makespan - simulate(spec, schedule, with_comm=False).makespan


def load_pipelines() -> dict:
    return json.loads(resources.files("autotune.reshard.presets").joinpath("pipelines.json").read_text())
