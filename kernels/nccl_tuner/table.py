"""The tuner table: the one format that ``python -m autotune nccl`` and ``python -m
autotune schedule`` write and the plugin (``tuner.c``) reads.

It is the CSV of NCCL's example tuner plugin, so that NCCL's own example reads it too:

    collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks[,numPipeOps[,regBuff]]

'#' starts a comment line. min_bytes..max_bytes is inclusive (2^64-1: no upper bound)
and is NCCL's nBytes for the call: the whole buffer, nccl-tests' size (allgather: the
gathered output; reducescatter: the input). channels -1 keeps NCCL's own count; nNodes,
nRanks, numPipeOps and regBuff -1 match anything. The first row that matches a call
decides it. ``read_table`` refuses what the plugin refuses (the whole table, with the
line), and ``decide`` is the plugin's rule in Python (the tests hold the two together).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from calibrate.errors import UserError

ENV_TABLE = "COMMTUNE_NCCL_TUNER_TABLE"
COLUMNS = ("collective_type", "min_bytes", "max_bytes", "algorithm", "protocol", "channels", "nNodes", "nRanks",
           "numPipeOps", "regBuff")
COLLECTIVES = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")  # NCCL's ncclFunc_t order
ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")  # cost table rows
PROTOCOLS = ("ll", "ll128", "simple")  # cost table columns
SIZE_MAX = (1 << 64) - 1
MAX_CHANNELS = 128
MAX_ROWS = 4096
MAX_LINE = 1024


@dataclass(frozen=True)
class Row:
    collective: str
    min_bytes: int
    max_bytes: int          # inclusive
    algorithm: str
    protocol: str
    channels: int = -1      # -1: NCCL's own count
    nodes: int = -1         # -1: any
    ranks: int = -1
    pipe_ops: int = -1
    reg_buff: int = -1

    def __post_init__(self):
        problem = self.problem()
        if problem:
            raise UserError(f"tuner table row: {problem}")

    def problem(self) -> str | None:
        if self.collective not in COLLECTIVES:
            return f"unknown collective {self.collective!r}: choose from {', '.join(COLLECTIVES)}"
        if not 0 <= self.min_bytes <= self.max_bytes <= SIZE_MAX:
            return "min_bytes and max_bytes must be sizes with min <= max"
        if self.algorithm not in ALGORITHMS:
            return f"unknown algorithm {self.algorithm!r}: choose from {', '.join(ALGORITHMS)}"
        if self.protocol not in PROTOCOLS:
            return f"unknown protocol {self.protocol!r}: choose from {', '.join(PROTOCOLS)}"
        if not (self.channels == -1 or 1 <= self.channels <= MAX_CHANNELS):
            return f"channels must be -1 or 1..{MAX_CHANNELS}"
        for name in ("nodes", "ranks", "pipe_ops"):
            if not (getattr(self, name) == -1 or getattr(self, name) >= 1):
                return f"{name} must be -1 or a positive count"
        if self.reg_buff not in (-1, 0, 1):
            return "regBuff must be -1, 0 or 1"
        return None

    def line(self) -> str:
        fields = [self.collective, self.min_bytes, self.max_bytes, self.algorithm, self.protocol, self.channels,
                  self.nodes, self.ranks]
        if self.pipe_ops != -1 or self.reg_buff != -1:
            fields += [self.pipe_ops, self.reg_buff]
        return ",".join(str(f) for f in fields)

    def applies_to(self, ranks: int, nodes: int) -> bool:
        return self.ranks in (-1, ranks) and self.nodes in (-1, nodes)

    def covers(self, collective: str, nbytes: int, pipe_ops: int = 1, reg_buff: int = -1) -> bool:
        return (self.collective == collective and self.min_bytes <= nbytes <= self.max_bytes
                and self.pipe_ops in (-1, pipe_ops) and (self.reg_buff == -1 or self.reg_buff == reg_buff))

    @property
    def setting(self) -> str:
        ch = "NCCL's channels" if self.channels == -1 else f"{self.channels} channels"
        return f"{self.algorithm}/{self.protocol}/{ch}"


def write_table(rows: list[Row], comments: list[str] = ()) -> str:
    """The table's text: ``comments`` (one '#' line each), the column names, the rows."""
    if len(rows) > MAX_ROWS:
        raise UserError(f"a tuner table holds at most {MAX_ROWS} rows, got {len(rows)}: use fewer size bands")
    lines = [f"# {c}" for c in comments]
    lines.append("# " + ",".join(COLUMNS))
    lines += [r.line() for r in rows]
    return "\n".join(lines) + "\n"


def _int(text: str, what: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise UserError(f"{what} {text!r} is not a whole number") from None


def read_table(text: str, source: str = "tuner table", allow_empty: bool = False) -> list[Row]:
    """Every row of a table's text, in order; a one-line ``UserError`` naming the first bad line.
    A table without rows is refused (the plugin ignores it) unless ``allow_empty``."""
    rows = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if len(raw) > MAX_LINE:
                raise UserError(f"longer than {MAX_LINE} characters")
            f = [x.strip() for x in line.split(",")]
            if not 8 <= len(f) <= 10:
                raise UserError(f"{len(f)} fields where 8 to 10 are expected")
            if not (f[1].isdigit() and f[2].isdigit()):
                raise UserError(f"min_bytes {f[1]!r} and max_bytes {f[2]!r} must be sizes in bytes")
            extra = [_int(x, c) for x, c in zip(f[8:], COLUMNS[8:])]
            rows.append(Row(f[0].lower(), int(f[1]), int(f[2]), f[3].lower(), f[4].lower(),
                            _int(f[5], "channels"), _int(f[6], "nNodes"), _int(f[7], "nRanks"), *extra))
        except UserError as e:
            msg = str(e).removeprefix("tuner table row: ")
            raise UserError(f"{source} line {n}: {msg}: fix the line or write the table again with "
                            f"python -m autotune nccl") from None
    if not rows and not allow_empty:
        raise UserError(f"{source} has no rows: write it with python -m autotune nccl")
    if len(rows) > MAX_ROWS:
        raise UserError(f"{source} has {len(rows)} rows, more than the plugin's {MAX_ROWS}")
    return rows


def load_table(path: str | Path, allow_empty: bool = False) -> list[Row]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"tuner table {str(p)!r} does not exist: write one with python -m autotune nccl")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the tuner table {str(p)!r} ({e}): write it again with python -m autotune nccl") \
            from None
    return read_table(text, f"tuner table {str(p)!r}", allow_empty)


def rows_for(rows: list[Row], ranks: int, nodes: int, source: str = "the tuner table") -> list[Row]:
    """The rows that apply to ``ranks`` on ``nodes``; refuses a table with none (written for another job shape)."""
    mine = [r for r in rows if r.applies_to(ranks, nodes)]
    if not mine:
        shapes = sorted({(r.ranks, r.nodes) for r in rows})
        said = ", ".join(f"{r} ranks on {n} node(s)" for r, n in shapes).replace("-1", "any")
        raise UserError(f"{source} has no row for {ranks} ranks on {nodes} node(s) (it is for {said}): "
                        f"tune on this job shape with python -m autotune nccl")
    return mine


def decide(rows: list[Row], collective: str, nbytes: int, available: set[tuple[str, str]],
           pipe_ops: int = 1, reg_buff: int = -1) -> tuple[str, str, int] | None:
    """The plugin's answer for one call: (algorithm, protocol, channels), or None to keep NCCL's choice.

    ``rows`` are those of this communicator (``rows_for``); ``available`` the (algorithm, protocol)
    pairs NCCL's cost table has not ruled out. The first covering row decides; if its pair is
    unavailable, NCCL keeps its choice."""
    for r in rows:
        if r.covers(collective, nbytes, pipe_ops, reg_buff):
            return (r.algorithm, r.protocol, r.channels) if (r.algorithm, r.protocol) in available else None
    return None


def merge_bands(rows: list[Row]) -> list[Row]:
    """Neighbouring rows of one collective and job shape with the same setting, joined into one."""
    out: list[Row] = []
    for r in rows:
        prev = out[-1] if out else None
        if (prev is not None and prev.max_bytes + 1 == r.min_bytes
                and dataclasses.replace(prev, min_bytes=0, max_bytes=0) == dataclasses.replace(r, min_bytes=0,
                                                                                                max_bytes=0)):
            out[-1] = dataclasses.replace(prev, max_bytes=r.max_bytes)
        else:
            out.append(r)
    return out
