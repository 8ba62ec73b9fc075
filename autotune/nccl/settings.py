"""The settings ``python -m autotune nccl`` measures: NCCL's algorithm x protocol x channel
count per collective, each applied through the plugin by a one-row-per-collective table on
its own communicator, and NCCL's default (no table, NCCL's own channels) beside them.

Algorithms per collective (NCCL 2.28): allreduce ring and tree; allgather and
reducescatter ring, and PAT where every node holds one rank; broadcast ring. NVLS and
CollNet need hardware the plugin cannot assume (NCCL rules them out in its cost table, and
a row naming them would leave NCCL's choice in place). Channels -1 is NCCL's own count on
a communicator of ``min_ctas`` channels: equal to the default's at small sizes, where NCCL
cuts channels by size, and every channel at large ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from calibrate.errors import OptionError, UserError
from kernels.nccl_tuner.table import PROTOCOLS, SIZE_MAX, Row

TUNABLE = ("allreduce", "allgather", "reducescatter", "broadcast")
DEFAULT_CHANNELS = (-1, 16, 32, 64)


@dataclass(frozen=True)
class Setting:
    """One candidate: (algorithm, protocol, channels); ``algorithm`` None is NCCL's default."""
    algorithm: str | None = None
    protocol: str | None = None
    channels: int = -1

    @property
    def is_default(self) -> bool:
        return self.algorithm is None

    @property
    def label(self) -> str:
        if self.is_default:
            return "default"
        return f"{self.algorithm}/{self.protocol}/{'auto' if self.channels == -1 else self.channels}"

    def row(self, collective: str, lo: int, hi: int, ranks: int, nodes: int) -> Row:
        return Row(collective, lo, hi, self.algorithm, self.protocol, self.channels, nodes, ranks)

    @classmethod
    def parse(cls, label: str) -> "Setting":
        if label == "default":
            return cls()
        a, p, c = label.split("/")
        return cls(a, p, -1 if c == "auto" else int(c))


DEFAULT = Setting()


def algorithms(collective: str, ranks: int, nodes: int) -> tuple[str, ...]:
    if collective == "allreduce":
        return ("ring", "tree")
    if collective in ("allgather", "reducescatter"):
        return ("ring", "pat") if ranks == nodes else ("ring",)
    return ("ring",)


def parse_channels(text: str, min_ctas: int) -> tuple[int, ...]:
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise OptionError("channels", f"{text!r}: write channel counts separated by commas, e.g. -1,16,32,64") from None
    bad = [v for v in values if not (v == -1 or 1 <= v <= min_ctas)]
    if not values or bad:
        raise OptionError("channels", f"{text!r}: each must be -1 (NCCL's own count) or 1..{min_ctas} ({{min_ctas}})")
    return tuple(values)


def candidates(collective: str, ranks: int, nodes: int, channels=DEFAULT_CHANNELS) -> list[Setting]:
    """NCCL's default first, then every (algorithm, protocol, channels) for ``collective``; Simple
    first, then LL128 and LL: the sweep drops a setting behind the best measured before it in the
    bandwidth regime, where Simple is the one to beat, so LL is dropped there early."""
    if collective not in TUNABLE:
        raise UserError(f"autotune nccl tunes {', '.join(TUNABLE)}, not {collective!r}")
    return [DEFAULT] + [Setting(a, p, c) for a in algorithms(collective, ranks, nodes) for p in PROTOCOLS[::-1]
                        for c in channels]


def setting_table(setting: Setting, collectives: list[str], ranks: int, nodes: int) -> list[Row]:
    """The table that applies ``setting`` to every size of the collectives it is a candidate for."""
    return [setting.row(c, 0, SIZE_MAX, ranks, nodes) for c in collectives
            if setting.algorithm in algorithms(c, ranks, nodes)]
