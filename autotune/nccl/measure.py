"""Measuring NCCL under each setting, on GPUs, one process per GPU.

Each setting gets its own communicator, created and destroyed explicitly on every rank:
the plugin reads its table when NCCL initializes it for a communicator, so the table
file (one row per collective, every size) is named in COMMTUNE_NCCL_TUNER_TABLE just
for that creation. NCCL loads the plugin once per process and keeps it: NCCL_TUNER_PLUGIN
is set before the first communicator, and NCCL's default is a communicator made while no
table is named (the plugin then leaves every choice to NCCL) and without a channel
configuration. Timing is the measurement engine (``calibrate.measure.engine``) on
``calibrate``'s NCCL backend in graph mode (the calls captured in a CUDA graph, CUDA events,
median of the replays, maximum over ranks); every measured point is checked on fresh random
data, and every compared one before and after its timed replays.

A comparison has named arms, each a communicator (``ablation_arms``): NCCL's default, the
default with the tuned communicators' channel floor alone (NCCL_MIN_CTAS), the table alone
(no floor), the table with the floor (what the env file sets), and the best fixed setting of
the development sweep with the floor, so that each part of a gain is attributed.
"""
from __future__ import annotations

import ctypes
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from calibrate.backends.base import CollectiveArm, TimingMode
from calibrate.backends.nccl import NcclBackend
from calibrate.collectives import Collective
from calibrate.device import nccl as device_nccl
from calibrate.errors import UserError
from calibrate.measure import engine
from calibrate.measure.stats import median
from calibrate.sizes import align
from kernels.nccl_tuner.table import ENV_TABLE, Row, write_table

from autotune.nccl.record import Compare, Sample
from autotune.nccl.settings import Setting, setting_table

DEFAULT, MIN_CTAS, TABLE, TUNED = "default", "min_ctas", "table", "tuned"

# environment that would change NCCL's default or the settings under the tuner's feet
FORBIDDEN_ENV = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NRINGS",
                 "NCCL_MAX_NRINGS", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS", ENV_TABLE)


def check_environment(plugin: Path) -> None:
    """Refuse an environment in which NCCL's default is not NCCL's default (before any communicator)."""
    for name in FORBIDDEN_ENV:
        if os.environ.get(name):
            raise UserError(f"{name} is set ({os.environ[name]!r}): unset it; autotune nccl measures NCCL's own "
                            f"default against the settings it applies itself")
    other = os.environ.get("NCCL_TUNER_PLUGIN")
    if other and Path(other).resolve() != plugin:
        raise UserError(f"NCCL_TUNER_PLUGIN is set to another plugin ({other!r}): unset it")


@dataclass
class Options:
    dtype: str = "float32"
    iters: int = 20
    warmup: int = 5
    reps: int = 5
    check: bool = True
    prune: float = 1.5       # the factor behind the best at which a setting that is not catching up is dropped
    channels_from: int = 256 << 10  # below this size only NCCL's own channel count is measured


@dataclass
class Session:
    world: object            # the MPI communicator of the ranks measured
    device: int
    plugin: Path
    min_ctas: int
    ranks: int
    nodes: int
    options: Options
    nccl_version: int = field(init=False)
    _workdir: Path = field(init=False)
    _counters: ctypes.CDLL = field(init=False)

    def __post_init__(self):
        self.group = engine.MpiGroup(self.world)
        os.environ["NCCL_TUNER_PLUGIN"] = str(self.plugin)  # before the first communicator of this process
        self.nccl_version = device_nccl.nccl_module("autotune nccl").get_version()
        self._workdir = Path(tempfile.mkdtemp(prefix="commtune-nccl-"))
        self._counters = ctypes.CDLL(str(self.plugin))  # the object NCCL loads: same path, same library

    def counters(self) -> dict:
        return {n: ctypes.c_ulong.in_dll(self._counters, f"commtune_tuner_{n}").value for n in ("inits", "decided")}

    def backend(self, rows: list[Row] | None, min_ctas: int | None) -> NcclBackend:
        """A backend on a new communicator: the plugin applies ``rows`` (None: no table, NCCL's choices)."""
        before = self.counters()["inits"]
        if rows:
            path = self._workdir / f"table-{time.monotonic_ns()}.csv"  # local to each rank: no shared file system
            path.write_text(write_table(rows, ["one setting of python -m autotune nccl"]))
            os.environ[ENV_TABLE] = str(path)
        try:
            be = NcclBackend(self.world, device=self.device, min_ctas=min_ctas)
        finally:
            os.environ.pop(ENV_TABLE, None)
        loaded = self.world.allreduce(int(self.counters()["inits"] > before), op=_min())
        if not loaded:
            be.close()
            raise UserError(f"NCCL did not initialize the tuner plugin {self.plugin} for a new communicator "
                            f"(NCCL {self.nccl_version}): run with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING "
                            f"to see why")
        return be

    def decided(self) -> int:
        """Calls a table row decided so far, the fewest over ranks."""
        return self.world.allreduce(self.counters()["decided"], op=_min())

    def noted(self, collective: str, nbytes: int) -> str:
        """The algorithm/protocol NCCL ran for the last call, if it was ``collective`` of ``nbytes``
        (the plugin notes NCCL's pick, or its row's); rank 0's, so that every rank agrees."""
        return self.world.bcast(self.noted_here(collective, nbytes), root=0)

    def noted_here(self, collective: str, nbytes: int) -> str:
        """``noted`` on this rank alone."""
        from kernels.nccl_tuner.table import ALGORITHMS, COLLECTIVES, PROTOCOLS

        def get(name, kind=ctypes.c_int):
            return kind.in_dll(self._counters, f"commtune_tuner_last_{name}").value

        runs = ""
        coll, algo, proto = get("coll"), get("algo"), get("proto")
        if (0 <= coll < len(COLLECTIVES) and COLLECTIVES[coll] == collective and 0 <= algo < len(ALGORITHMS)
                and 0 <= proto < len(PROTOCOLS) and get("bytes", ctypes.c_ulonglong) == nbytes):
            runs = f"{ALGORITHMS[algo]}/{PROTOCOLS[proto]}"
        return runs

    def arm(self, be: NcclBackend, collective: str, nbytes: int) -> "NcclArm":
        coll = Collective.parse(collective)
        nbytes, _ = align(coll, nbytes, self.ranks, self.options.dtype)
        return NcclArm(self, be, coll, nbytes, self.options.dtype)

    def measure(self, be: NcclBackend, collective: str, nbytes: int, setting: str, reps: int | None = None,
                check: bool = True, iters: int | None = None) -> Sample:
        """One point: ``reps`` replays of a CUDA graph of ``iters`` calls (the options' by default)."""
        coll = Collective.parse(collective)
        o = self.options
        nbytes, _ = align(coll, nbytes, self.ranks, o.dtype)
        samples = be.measure(coll, nbytes, o.dtype, iters or o.iters, o.warmup, TimingMode.GRAPH, reps or o.reps)
        wrong = be.check(coll, nbytes, o.dtype, seed=nbytes) if o.check and check else -1
        us = [float(x) * 1e6 for x in samples]
        return Sample(collective, nbytes, setting, median(us), us, int(wrong), self.noted(collective, nbytes))

    def close(self):
        for p in self._workdir.glob("*.csv"):
            p.unlink()
        self._workdir.rmdir()


class NcclArm(CollectiveArm):
    """A collective on one arm's communicator; ``runs``: what NCCL ran at its last check (this rank's)."""

    def __init__(self, session: Session, be: NcclBackend, coll: Collective, nbytes: int, dtype: str):
        super().__init__(be, coll, nbytes, dtype)
        self.session, self.runs = session, ""

    def check(self, seed: int) -> int:
        wrong = super().check(seed)
        self.runs = self.session.noted_here(self.coll.value, self.nbytes)
        return wrong


def _min():
    from mpi4py import MPI

    return MPI.MIN


def falling_behind(prev: tuple[int, float], cur: tuple[int, float], best_prev: float, best_cur: float,
                   prune: float) -> bool:
    """Whether a setting measured ``prev`` = (size, us) then ``cur`` stays behind the best at every larger
    size, in the alpha-beta model (t = alpha + beta * n) of each setting.

    It must be more than ``prune`` times slower than the best (``best_prev``, ``best_cur``: the fastest
    time measured at those two sizes) at both, and not catching up: its time grew at least as much as the
    best's between the two sizes, so its beta is at least that of the setting fastest at ``cur`` (the best's
    growth bounds that one's from above). That growth is only trusted where the best is bandwidth-bound
    (its beta term at least its alpha term: it grew by at least half the size's growth); in the latency
    regime nothing is dropped, since a setting far behind there (Simple against LL) may be the fastest at
    larger sizes, where its smaller beta wins."""
    (n0, t0), (n1, t1) = prev, cur
    if not (n1 > n0 and t0 > prune * best_prev and t1 > prune * best_cur):
        return False
    grown = best_cur - best_prev
    return grown >= 0.5 * (n1 / n0 - 1) * best_prev and t1 - t0 >= grown


def sweep(session: Session, plan: dict[str, list[Setting]], sizes: list[int], on_sample, on_setting) -> dict:
    """Measure every setting of ``plan`` (collective -> settings, NCCL's default first) at ``sizes``.

    One communicator per setting, for all the collectives it is a candidate of. Not measured
    (``on_sample(None, coll, n, setting, why)``): a setting with a fixed channel count below
    ``options.channels_from`` (``why`` "channels": there NCCL's own count, measured as the ``/auto``
    setting, is cut by size and the fixed counts differ by noise), and a setting that has been
    ``falling_behind`` at two size steps in a row, at the larger sizes of that collective (``why``
    "behind"). The best is over the settings measured before it and itself, NCCL's default apart, so
    the first setting is measured at every size: each size keeps a measured setting to choose.
    ``on_setting(k, total, setting, seconds, applied)`` after each; ``applied`` is False when the
    plugin decided no call (NCCL ruled the setting out: what was measured is NCCL's choice).
    Returns seconds per collective (measuring) and for making communicators."""
    order = list(dict.fromkeys(s for settings in plan.values() for s in settings))
    best: dict[tuple[str, int], float] = {}
    o = session.options
    seconds = {c: 0.0 for c in plan} | {"communicators": 0.0}
    for k, setting in enumerate(order):
        colls = [c for c in plan if setting in plan[c]]
        t0 = time.perf_counter()
        rows = None if setting.is_default else setting_table(setting, colls, session.ranks, session.nodes)
        be = session.backend(rows, None if setting.is_default else session.min_ctas)
        seconds["communicators"] += time.perf_counter() - t0
        decided = session.decided()
        try:
            for coll in colls:
                t0 = time.perf_counter()
                steps, prev = 0, None
                for n in sizes:
                    if not setting.is_default and setting.channels != -1 and n < o.channels_from:
                        on_sample(None, coll, n, setting, "channels")
                        continue
                    if steps >= 2:
                        on_sample(None, coll, n, setting, "behind")
                        continue
                    s = session.measure(be, coll, n, setting.label)
                    on_sample(s, coll, n, setting, "")
                    if setting.is_default:
                        continue
                    best[(coll, n)] = min(best.get((coll, n), float("inf")), s.median_us)
                    cur = (n, s.median_us)
                    # from channels_from on every setting is measured at both sizes of a step
                    behind = prev is not None and prev[0] >= o.channels_from and falling_behind(
                        prev, cur, best[(coll, prev[0])], best[(coll, n)], o.prune)
                    steps = steps + 1 if behind else 0
                    prev = cur
                seconds[coll] += time.perf_counter() - t0
        finally:
            t0 = time.perf_counter()
            be.close()
            seconds["communicators"] += time.perf_counter() - t0
        # a setting NCCL ruled out everywhere (the plugin then keeps NCCL's choice) measured the default
        applied = setting.is_default or session.decided() > decided
        on_setting(k + 1, len(order), setting, seconds, applied)
    return seconds


GRAPH_US = 1000.0      # a compared point's CUDA graph lasts at least this long (more calls at small sizes)


def ablation_arms(rows: list[Row], min_ctas: int, fixed: list[Row] | None = None,
                  fixed_label: str = "") -> dict[str, tuple[list[Row] | None, int | None]]:
    """name -> (table rows or None, channel floor or None) of each arm: NCCL's default, the floor alone,
    the table alone, both (what the env file sets) and, given, the best fixed setting with the floor."""
    arms = {DEFAULT: (None, None), MIN_CTAS: (None, min_ctas), TABLE: (rows, None), TUNED: (rows, min_ctas)}
    if fixed:
        arms[f"fixed {fixed_label}"] = (fixed, min_ctas)
    return arms


def compare(session: Session, arms: dict[str, dict[str, tuple]], sizes: list[int] | dict[str, list[int]], on_row,
            rounds: int = 5, table: list[Row] | None = None) -> float:
    """Per collective (``arms``: collective -> ``ablation_arms``), each arm on its own new communicator;
    per size (``sizes``, or ``sizes[collective]``) one engine comparison of all of them: checked before and after, CUDA graphs of at least
    ``options.iters`` calls and ``GRAPH_US``, ``rounds`` x ``options.reps`` replays interleaved arm by
    arm, median, maximum over ranks. An arm whose communicator cannot be made is a row saying why.
    ``table``: the rows whose setting labels each size (default: the tuned arm's). Returns seconds."""
    t0 = time.perf_counter()
    o = session.options
    opts = engine.Options(TimingMode.GRAPH, rounds=rounds * o.reps, calls=o.iters, min_batch_s=GRAPH_US * 1e-6,
                          warmup=o.warmup, check=o.check)
    for coll, mine in arms.items():
        made: dict[str, tuple[object, str]] = {}
        try:
            for name, (rows, ctas) in mine.items():
                made[name] = session.group.agree(lambda rows=rows, ctas=ctas: session.backend(rows, ctas))
            for n in (sizes[coll] if isinstance(sizes, dict) else sizes):
                live: dict[str, NcclArm] = {}

                def factory(name, n=n):
                    be, err = made[name]
                    if err:
                        raise UserError(f"no communicator: {err}")
                    live[name] = session.arm(be, coll, n)
                    return live[name]

                res = engine.compare(session.group, [(name, lambda name=name: factory(name)) for name in mine],
                                     replace(opts, seed=n))
                nbytes = next(iter(live.values())).nbytes if live else n
                runs = session.world.bcast({k: a.runs for k, a in live.items()}, root=0)
                label_rows = table if table is not None else (mine.get(TUNED, (None, None))[0] or [])
                row = next((r for r in label_rows if r.covers(coll, nbytes)), None)
                setting = "default" if row is None else Setting(row.algorithm, row.protocol, row.channels).label
                on_row(Compare.from_comparison(coll, nbytes, setting, res, runs))
        finally:
            for be, err in made.values():
                if not err:
                    be.close()
    return time.perf_counter() - t0

