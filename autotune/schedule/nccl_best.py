"""NCCL's best setting at a held-out size of the schedule evaluation, chosen from the development
sweep of an NCCL tuning run (``python -m autotune schedule evaluate --nccl-run DIR``).

``python -m autotune nccl`` measures NCCL under every (algorithm, protocol, channels) setting, each
on a communicator of ``min_ctas`` channels, at its sweep sizes, and chooses per size band the
fastest (``autotune.nccl.choose``): its table. NCCL's best setting at a held-out size is the row
of that table covering the size, applied as the NCCL tuner applies it: the tuner plugin reading
the table on a communicator of ``min_ctas`` channels (``autotune.nccl.measure.Session.backend``).
Where the table has no row, the sweep found no setting faster than NCCL's default there, and the
arm is NCCL's default. The NCCL run's measurements are development ones; a held-out size its sweep
measured would not be held out, and is an arm that says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from calibrate.errors import UserError
from kernels.nccl_tuner.table import Row, read_table

from autotune.nccl.record import TuneRecord
from autotune.nccl.settings import Setting


@dataclass(frozen=True)
class NcclBest:
    path: str                       # the NCCL run's nccl_tune.json
    device: str
    nccl_version: int
    min_ctas: int
    plugin: str                     # the plugin that run used
    collectives: tuple[str, ...]
    sizes: tuple[int, ...]          # its sweep sizes (development)
    rows: tuple[Row, ...]           # its table, the rows for this job's ranks and nodes

    def to_dict(self) -> dict:
        return {"path": self.path, "device": self.device, "nccl_version": self.nccl_version,
                "min_ctas": self.min_ctas, "plugin": self.plugin, "table_rows": [r.line() for r in self.rows]}

    def setting(self, collective: str, nbytes: int) -> Row | None | str:
        """The table row for ``collective`` at ``nbytes``, None where the sweep chose NCCL's default, or
        why NCCL's best setting there is unknown."""
        if collective not in self.collectives:
            return f"the NCCL run {self.path} did not tune {collective}"
        if nbytes in self.sizes:
            return f"the NCCL run's sweep measured {nbytes} B: its setting there was not chosen without it"
        return next((r for r in self.rows if r.covers(collective, nbytes)), None)

    def label(self, collective: str, nbytes: int) -> str:
        s = self.setting(collective, nbytes)
        if isinstance(s, str):
            return s
        if s is None:
            return "NCCL's default (the sweep found no faster setting there)"
        return f"{Setting(s.algorithm, s.protocol, s.channels).label} with NCCL_MIN_CTAS={self.min_ctas}"


def load_nccl_run(path: str, ranks: int, nodes: int, dtype: str) -> NcclBest:
    """The NCCL run at ``path`` (its directory or nccl_tune.json), checked against this job's shape and
    element type; a one-line ``UserError`` naming the problem otherwise."""
    p = Path(path)
    p = p / "nccl_tune.json" if p.is_dir() else p
    dev = TuneRecord.load(p)
    if (dev.ranks, dev.nodes) != (ranks, nodes):
        raise UserError(f"--nccl-run {str(p)!r} was measured on {dev.ranks} ranks over {dev.nodes} node(s), this "
                        f"evaluation has {ranks} over {nodes}: give a run of this job shape")
    if dev.dtype != dtype:
        raise UserError(f"--nccl-run {str(p)!r} measured {dev.dtype}, the schedule run {dtype}: give a run of {dtype}")
    if not dev.sweep:
        raise UserError(f"--nccl-run {str(p)!r} has no development sweep (its table was given with --table, not "
                        f"chosen by it): give the directory of a python -m autotune nccl run that swept")
    if not dev.table:
        raise UserError(f"--nccl-run {str(p)!r} wrote no table (the run stopped before choosing): give a run that "
                        f"finished")
    rows = read_table("\n".join(dev.table_rows), f"the table of {str(p)!r}", allow_empty=True)
    return NcclBest(str(p), dev.device, dev.nccl_version, dev.min_ctas, dev.plugin, tuple(dev.collectives),
                    tuple(dev.sizes), tuple(r for r in rows if r.applies_to(ranks, nodes)))


class NcclBestArms:
    """The NCCL-best arm at each size: one communicator per collective with the run's table and
    ``min_ctas`` channels (made on first use, every rank together), or NCCL's default where the
    table has no row. Needs the ``Session`` made before any other NCCL communicator of the process
    (the plugin is loaded then)."""

    def __init__(self, best: NcclBest, session):
        self.best, self.session = best, session
        self._made: dict[str, tuple[object, str]] = {}

    def arm(self, collective: str, nbytes: int):
        """An arm for ``kernels.interp.bench.compare_choices``: a factory of an engine arm, None (NCCL's
        default, called directly), or a ``UserError`` saying why there is none."""
        s = self.best.setting(collective, nbytes)
        if isinstance(s, str):
            return UserError(s)
        if s is None:
            return None
        if collective not in self._made:
            rows = [r for r in self.best.rows if r.collective == collective]
            self._made[collective] = self.session.group.agree(
                lambda: self.session.backend(rows, self.best.min_ctas))
        be, err = self._made[collective]
        if err:
            return UserError(f"no communicator with the NCCL run's table: {err}")
        return lambda: self.session.arm(be, collective, nbytes)

    def close(self) -> None:
        for be, err in self._made.values():
            if not err:
                be.close()
        self._made.clear()
        self.session.close()
