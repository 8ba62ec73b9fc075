"""Pipeline schedules (GPipe, 1F1B, eager-1F1B; §4) as per-stage orders of
compute tasks, and a time-ordered simulator that overlaps inter-stage
communication with computation wherever the dependencies allow.

Model: each stage runs its compute tasks one at a time, in the schedule's fixed
order, and starts a task only when its inputs have arrived. F(s, m) needs the
activation of micro-batch m from stage s-1 and from every skip connection that
ends at s; B(s, m) needs F(s, m), the gradient from stage s+1 and the gradient
of every skip connection that starts at s. Each stage sits on its own hosts
(§3's host-level model): a transfer from stage a to stage b occupies a's send
port and b's receive port (full duplex), starts when its producer ends and both
ports are free (earliest ready first), and overlaps with whatever the stages
compute meanwhile.

Transfers run in one of two ways (``overlap``):
- overlapped (the default; the paper's "Overlap" and eager-1F1B): as above, a
  transfer runs beside whatever the two stages compute;
- blocking (``overlap=False``; Alpa's runtime, the paper's "Broadcast" baseline
  of §5.3.2): send and receive are instructions of the stages' own streams, so a
  transfer runs only while both stages are idle and the receiver has reached the
  task that consumes it, and neither stage computes until it ends. This is the
  paper's "compute of stage i, communication, compute of stage i+1 scheduled
  contiguously": no transfer is ever hidden (tested).

Warm-up forwards before the first backward, stage s of S (0-indexed; the paper
counts from 1): 1F1B runs S - s (the paper's #stages - i + 1), eager-1F1B runs
2(S - s) - 1 (the paper's 2(#stages - i) + 1), GPipe runs all M.

Interleaved 1F1B (``INTERLEAVED``; Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``, torch's
``ScheduleInterleaved1F1B``): the spec's S stages are virtual, v = S / p chunks on each of p ranks (``ranks``),
virtual stage s on rank s mod p, so a micro-batch passes every rank v times (S - 1 boundaries, v times the
1F1B's P2P). A rank runs its chunks' tasks one at a time in Megatron's order: forwards in groups of p
micro-batches, chunk by chunk (the k-th forward: chunk (k // p) mod v, micro-batch (k // pv) p + k mod p;
backwards the same with the chunks last to first), (p - r - 1) 2 + (v - 1) p warm-up forwards on rank r,
then one forward and one backward in turn. The bubble is (p - 1) / (v m) of the compute, against
(p - 1) / m for 1F1B. m must be a multiple of p (as Megatron-LM asks).
"""
from __future__ import annotations

import bisect
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
INTERLEAVED = "interleaved_1f1b"  # simulated on virtual stages (module docstring), not one of SCHEDULES


def interleaved_warmup(rank: int, ranks: int, virtual: int, micro_batches: int) -> int:
    """Forward chunks rank ``rank`` runs before its first backward (Megatron-LM's count), at most all of them."""
    return min((ranks - rank - 1) * 2 + (virtual - 1) * ranks, micro_batches * virtual)


def interleaved_orders(ranks: int, virtual: int, micro_batches: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's tasks (kind, micro-batch, virtual stage) in Megatron-LM's interleaved order."""
    if micro_batches % ranks:
        raise UserError(f"interleaved 1F1B runs micro-batches in groups of the {ranks} pipeline ranks: use a "
                        f"multiple of {ranks} micro-batches, not {micro_batches}")

    def task(kind: str, k: int, r: int) -> tuple[str, int, int]:
        chunk = (k // ranks) % virtual
        chunk = chunk if kind == "F" else virtual - 1 - chunk
        return kind, (k // (ranks * virtual)) * ranks + k % ranks, chunk * ranks + r

    out = []
    total = micro_batches * virtual
    for r in range(ranks):
        w = interleaved_warmup(r, ranks, virtual, micro_batches)
        order = [task("F", k, r) for k in range(w)]
        for j in range(total - w):
            order += [task("F", w + j, r), task("B", j, r)]
        order += [task("B", k, r) for k in range(total - w, total)]
        out.append(order)
    return out


@dataclass(frozen=True)
class Skip:
    """A skip connection from stage ``src`` to a later, non-adjacent stage ``dst`` (U-Net style)."""

    src: int
    dst: int
    forward: float   # seconds per micro-batch, src -> dst
    backward: float  # its gradient, dst -> src


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    micro_batches: int
    forward: tuple[float, ...]        # seconds per micro-batch, per stage
    backward: tuple[float, ...]
    comm_forward: tuple[float, ...]   # boundary s -> s+1, seconds per micro-batch
    comm_backward: tuple[float, ...]  # boundary s+1 -> s
    activation_bytes: tuple[float, ...]
    skips: tuple[Skip, ...] = ()

    def __post_init__(self):
        s = len(self.forward)
        if s < 1 or self.micro_batches < 1:
            raise UserError(f"pipeline {self.name!r} needs at least one stage and one micro-batch")
        if len(self.backward) != s or len(self.activation_bytes) != s:
            raise UserError(f"pipeline {self.name!r}: give forward, backward and activation_bytes for all {s} stages")
        if len(self.comm_forward) != s - 1 or len(self.comm_backward) != s - 1:
            raise UserError(f"pipeline {self.name!r}: give {s - 1} communication times per direction (one per boundary)")
        for k in self.skips:
            if not 0 <= k.src < k.dst - 1 < s - 1:
                raise UserError(f"pipeline {self.name!r}: skip {k.src}->{k.dst} must join a stage to a later, "
                                f"non-adjacent stage of the {s} (adjacent stages share their boundary)")

    @property
    def stages(self) -> int:
        return len(self.forward)

    def edges(self) -> list[tuple[int, int, float, float]]:
        """(src, dst, forward s, backward s) of every boundary and skip connection."""
        out = [(s, s + 1, self.comm_forward[s], self.comm_backward[s]) for s in range(self.stages - 1)]
        return out + [(k.src, k.dst, k.forward, k.backward) for k in self.skips]


@dataclass(frozen=True)
class Interval:
    lane: str      # "stage 0", or "link 0>1" / "link 1>0" for the transfers from one stage to another
    kind: str      # F, B, or C (communication)
    micro_batch: int
    start: float
    end: float
    stage: int = -1  # the (virtual) stage a compute interval runs (interleaved: several on one lane)


@dataclass
class PipelineResult:
    schedule: str
    makespan: float
    throughput: float                 # micro-batches per second
    peak_activations: list[int]       # per stage, in micro-batches
    peak_memory: list[float]          # per stage, bytes
    comm_time: float                  # all transfers, summed
    comm_wait: float                  # transfer time during which the consumer stage sat idle
    steady: tuple[float, float] = (0.0, 0.0)  # the window in which every stage is in its 1F1B phase
    intervals: list[Interval] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["intervals"] = [asdict(i) for i in self.intervals]
        return d


def simulate(spec: PipelineSpec, schedule: str, with_comm: bool = True, overlap: bool = True,
             ranks: int | None = None) -> PipelineResult:
    """The schedule run on the spec: one lane (a rank) per stage, or with ``INTERLEAVED`` the spec's stages
    virtual on ``ranks`` lanes (module docstring); lanes are named "stage i"."""
    S, M = spec.stages, spec.micro_batches
    if schedule == INTERLEAVED:
        if not ranks or S % ranks or S == ranks:
            raise UserError(f"interleaved 1F1B needs its {S} virtual stages to be a multiple (at least 2) of the "
                            f"ranks, not {ranks}")
        orders = interleaved_orders(ranks, S // ranks, M)
    elif schedule not in SCHEDULES:
        raise UserError(f"unknown pipeline schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}, {INTERLEAVED}")
    else:
        orders = [[(k, m, s) for k, m in o] for s, o in enumerate(SCHEDULES[schedule]().orders(S, M))]
    L = len(orders)
    lane = [s % L for s in range(S)]
    edges = [(a, b, f if with_comm else 0.0, g if with_comm else 0.0) for a, b, f, g in spec.edges()]
    needs_f = {s: [a for a, b, _, _ in edges if b == s] for s in range(S)}  # F(s, m) waits on these producers
    needs_b = {s: [b for a, b, _, _ in edges if a == s] for s in range(S)}  # B(s, m) waits on these
    out_f = {s: [(b, f) for a, b, f, _ in edges if a == s] for s in range(S)}
    out_b = {s: [(a, g) for a, b, _, g in edges if b == s] for s in range(S)}
    ptr, free = [0] * L, [0.0] * L
    sends, recvs = [0.0] * L, [0.0] * L  # per lane: when its send port and its receive port are next free
    arrival: dict[tuple[str, int, int, int], float] = {}  # (kind, producer, consumer, m)
    pending: list[tuple[float, str, int, int, int, float]] = []  # (ready, kind, src, dst, m, seconds)
    fdone: dict[tuple[int, int], float] = {}
    events: list[tuple[float, int, int, int]] = []  # (time, order, stage, delta) for memory
    intervals: list[Interval] = []
    transfers: list[tuple[int, float, float]] = []  # (consumer, start, end)
    remaining = sum(len(o) for o in orders)
    head: list = [None] * L  # per lane: its next compute's earliest start, False while it cannot start, None: stale
    while remaining or pending:
        best = None  # (start, 0 = transfer | 1 = compute, index)
        for i, (ready, kind, a, b, m, _) in enumerate(pending):
            la, lb = lane[a], lane[b]
            start = max(ready, sends[la], recvs[lb])
            if not overlap:
                if ptr[lb] == len(orders[lb]) or orders[lb][ptr[lb]] != (kind, m, b):
                    continue  # the receiver has not reached the receive before its consumer
                start = max(start, free[la], free[lb])
            if best is None or (start, 0, ready) < best[:3]:
                best = (start, 0, ready, i)
        for ln in range(L):
            start = head[ln]
            if start is None:  # what it waits on changes only by its own computes and the transfers into it
                start = head[ln] = _head_start(orders[ln], ptr[ln], free[ln], needs_f, needs_b, arrival, fdone)
            if start is not False and (best is None or (start, 1, 0.0) < best[:3]):
                best = (start, 1, 0.0, ln)
        if best is None:
            raise UserError(f"schedule {schedule!r} deadlocks on pipeline {spec.name!r}: its orders are inconsistent")
        start, what, _, idx = best
        if what == 0:
            _, kind, a, b, m, dur = pending.pop(idx)
            end = start + dur
            la, lb = lane[a], lane[b]
            sends[la] = recvs[lb] = end
            head[la] = head[lb] = None
            if not overlap:
                free[la] = free[lb] = end
            arrival[(kind, a, b, m)] = end
            if dur > 0:
                intervals.append(Interval(f"link {la}>{lb}", "C", m, start, end))
                transfers.append((lb, start, end))
            continue
        ln = idx
        kind, m, s = orders[ln][ptr[ln]]
        end = start + (spec.forward[s] if kind == "F" else spec.backward[s])
        free[ln], head[ln] = end, None
        intervals.append(Interval(f"stage {ln}", kind, m, start, end, s))
        if kind == "F":
            fdone[(s, m)] = end
            events.append((start, 1, ln, +1))
            pending += [(end, "F", s, b, m, f) for b, f in out_f[s]]
        else:
            events.append((end, 0, ln, -1))
            pending += [(end, "B", s, a, m, g) for a, g in out_b[s]]
        ptr[ln] += 1
        remaining -= 1
    held, peak = [0] * L, [0] * L
    for _, _, s, delta in sorted(events):
        held[s] += delta
        peak[s] = max(peak[s], held[s])
    ms = max(i.end for i in intervals)
    comm = sum(e - b for _, b, e in transfers)
    busy: dict[int, list[tuple[float, float]]] = {s: [] for s in range(L)}
    for iv in intervals:
        if iv.lane.startswith("stage "):
            busy[int(iv.lane[6:])].append((iv.start, iv.end))
    idle = sum((e - b) - _overlap(b, e, busy[c]) for c, b, e in transfers)
    return PipelineResult(schedule, ms, M / ms, peak, [p * a for p, a in zip(peak, spec.activation_bytes)],
                          comm, idle, _steady_window(intervals, L), intervals)


def _head_start(order: list, at: int, free: float, needs_f: dict, needs_b: dict, arrival: dict, fdone: dict):
    """The earliest start of a lane's next compute (``order[at]``): when the lane is free and its inputs have
    arrived (a backward's own forward done, its gradients from the later stages); False where one has not yet
    or the lane is done."""
    if at == len(order):
        return False
    kind, m, s = order[at]
    if kind == "F":
        deps = [arrival.get(("F", a, s, m)) for a in needs_f[s]]
    else:
        deps = [fdone.get((s, m))] + [arrival.get(("B", b, s, m)) for b in needs_b[s]]
    return False if any(d is None for d in deps) else max([free, *deps])


def _overlap(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    """The time of [start, end) inside ``spans``: one stage's intervals, in time order and disjoint."""
    total = 0.0
    for k in range(bisect.bisect_right(spans, start, key=lambda x: x[1]), len(spans)):
        b, e = spans[k]
        if b >= end:
            break
        total += max(0.0, min(end, e) - max(start, b))
    return total


def _steady_window(intervals: list[Interval], stages: int) -> tuple[float, float]:
    """From the last stage's first backward to the first stage's last forward: every stage alternates there."""
    first_b = max(min(i.start for i in intervals if i.lane == f"stage {s}" and i.kind == "B") for s in range(stages))
    last_f = min(max(i.end for i in intervals if i.lane == f"stage {s}" and i.kind == "F") for s in range(stages))
    return (first_b, max(first_b, last_f))


PHASES = ("warmup", "steady", "cooldown")


def hidden_fraction(result: PipelineResult, phase: str | None = None) -> float | None:
    """Share of the inter-stage communication hidden behind computation.

    A transfer is hidden for the part of it during which its consumer stage is
    busy computing (other micro-batches, in the paper's Fig. 4 magnified view),
    exposed while the consumer sits idle: hidden = sum over transfers of
    (busy overlap) / sum of transfer times. ``phase`` counts only the transfers
    that start before (warmup), inside (steady) or after (cooldown) the steady
    window ``PipelineResult.steady``; None when no transfer falls there (a
    GPipe schedule has no steady window).
    """
    if phase is not None and phase not in PHASES:
        raise UserError(f"unknown pipeline phase {phase!r}: choose one of {', '.join(PHASES)}")
    lo, hi = result.steady
    tr = [i for i in result.intervals if i.kind == "C"]
    if phase is not None:
        tr = [i for i in tr if PHASES[0 if i.start < lo else 2 if i.start >= hi else 1] == phase]
    total = sum(i.end - i.start for i in tr)
    if total <= 0:
        return None if phase else 1.0
    busy: dict[int, list[tuple[float, float]]] = {}
    for i in result.intervals:
        if i.kind != "C":
            busy.setdefault(int(i.lane.split()[1]), []).append((i.start, i.end))
    hidden = sum(_overlap(i.start, i.end, busy.get(int(i.lane.split(">")[1]), [])) for i in tr)
    return hidden / total


def exposed_time(spec: PipelineSpec, schedule: str, overlap: bool = True) -> float:
    """How much communication lengthens the iteration: makespan with it minus without it."""
    return simulate(spec, schedule, overlap=overlap).makespan - simulate(spec, schedule, with_comm=False).makespan


def load_pipelines() -> dict:
    return json.loads(resources.files("autotune.reshard.presets").joinpath("pipelines.json").read_text())
