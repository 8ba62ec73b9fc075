"""Where a figure comes from: the command, the commit and the machine, for every record a
table is rendered from."""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The project's git commit ("+dirty" with uncommitted changes to tracked files): ``COMMTUNE_COMMIT``
    where set (a copy of the tree without its .git, e.g. on a lent machine); else git's, when the
    repository git finds is this project's own (a copy inside another repository would otherwise report
    that one's commit); "" otherwise."""
    if os.environ.get("COMMTUNE_COMMIT"):
        return os.environ["COMMTUNE_COMMIT"]
    try:
        top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode or Path(top.stdout.strip()).resolve() != ROOT.resolve():
            return ""
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return ""
        dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"], capture_output=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.returncode else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def command() -> str:
    """This process's command line, as a shell would take it."""
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def machine() -> str:
    return f"{platform.node()} ({platform.machine()}, Python {platform.python_version()})"
