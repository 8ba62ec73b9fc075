"""Output paths checked before any work starts, so that a long run never ends
on an unwritable path, and files written whole or not at all: ``write_atomic``
writes a temporary file beside the target, syncs it and renames it over the
target, so that a kill or a full disk leaves the old file (or none), never a
truncated one."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from calibrate.errors import UserError


def check_output_path(path: str | Path, what: str = "output", directory: bool = False) -> Path:
    """``path`` as a Path if it can be written (created with its missing folders, or overwritten);
    raise ``UserError`` naming the obstacle otherwise. Creates nothing."""
    p = Path(path)
    if str(path) == "":
        raise UserError(f"the {what} path is empty: give a file name")
    if p.exists():
        if directory and not p.is_dir():
            raise UserError(f"the {what} {str(p)!r} exists and is not a directory: choose another path")
        if not directory and p.is_dir():
            raise UserError(f"the {what} {str(p)!r} is a directory: give a file name")
        target = p if directory else p.parent
        if not os.access(p, os.W_OK) or not os.access(target, os.W_OK | os.X_OK):
            raise UserError(f"the {what} {str(p)!r} is not writable: choose a writable path")
        return p
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot write the {what} {str(p)!r}: {str(parent)!r} is not a directory; "
                        f"choose a writable path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the {what} {str(p)!r}: {str(parent)!r} is not writable; "
                        f"choose a writable path")
    return p


def write_atomic(path: str | Path, data: str | bytes, what: str = "output") -> Path:
    """Write ``data`` to ``path`` whole or not at all (creating missing folders): a temporary file in
    the same folder, synced, then renamed over ``path``. A ``UserError`` names the file when the
    write fails (a full disk: the old file is kept)."""
    p = check_output_path(path, what)
    raw = data.encode() if isinstance(data, str) else data
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        if p.exists():
            os.chmod(tmp, p.stat().st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
        tmp = None
        sync_dir(p.parent)
    except OSError as e:
        raise UserError(f"cannot write the {what} {str(p)!r} ({e.strerror}): choose a writable path "
                        f"with free space") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return p


def sync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the file system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
