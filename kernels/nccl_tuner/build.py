"""Building the plugin with the system C compiler, into a known path."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from calibrate.errors import OptionError, UserError

SOURCE = Path(__file__).with_name("tuner.c")
LIBRARY_NAME = "libnccl-tuner-commtune.so"


def default_path() -> Path:
    """Where ``build`` puts the plugin unless told otherwise (``COMMTUNE_NCCL_TUNER_LIB`` overrides)."""
    env = os.environ.get("COMMTUNE_NCCL_TUNER_LIB")
    return Path(env) if env else Path(__file__).parent / "build" / LIBRARY_NAME


def compiler(cc: str | None = None) -> str:
    name = cc or os.environ.get("CC") or "cc"
    path = shutil.which(name)
    if path is None:
        raise OptionError("cc", f"{name!r}: no such C compiler on PATH: install one (Debian: apt-get install gcc) or "
                                f"name another")
    return path


def build(out: str | Path | None = None, cc: str | None = None) -> Path:
    """Compile ``tuner.c`` into a shared library at ``out`` (default ``default_path()``); returns its path.

    Written to a temporary file and renamed, so that ranks building at once never load a half-written file."""
    out = Path(out) if out else default_path()
    cc_path = compiler(cc)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise OptionError("out", f"{str(out.parent)!r}: cannot write the plugin there ({e.strerror}): give a "
                                 f"writable path") from None
    cmd = [cc_path, "-O2", "-Wall", "-Wextra", "-fPIC", "-shared", "-o", tmp, str(SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        first = (proc.stderr.strip().splitlines() or ["no message"])[0]
        raise UserError(f"compiling the NCCL tuner plugin failed ({' '.join(cmd)}): {first}")
    os.replace(tmp, out)
    return out


def library(path: str | Path | None = None) -> Path:
    """The built plugin's path, absolute; a one-line error when it is not there."""
    p = Path(path) if path else default_path()
    if not p.is_file():
        raise UserError(f"the NCCL tuner plugin {str(p)!r} is not built: run python -m kernels build-tuner"
                        + (f" --out {p}" if path else ""))
    return p.resolve()
