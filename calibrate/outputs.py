"""Output paths checked before any work starts, so that a long run never ends
on an unwritable path."""
from __future__ import annotations

import os
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
