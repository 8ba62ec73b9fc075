"""Output paths checked before any work starts, so that a long run never ends
on an unwritable path, and files written whole or not at all: ``write_atomic``
writes a temporary file beside the target, syncs it and renames it over the
target, so that a kill or a full disk leaves the old file (or none), never a
truncated one. ``write_together`` does the same for files that belong together
(a plan and its report): both or neither.

A temporary file is named for its target, host and process
(``.plan.json.HOST.PID.XXXX.tmp``): it is removed on an error, Ctrl-C or SIGTERM
(the command layer turns SIGTERM into an exit), and one a kill -9 left is removed
by the next write into its folder (``remove_stale``) once its process is gone."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from calibrate.errors import UserError

# a temporary file of write_atomic: .NAME.HOST.PID.RANDOM.tmp (HOST with its dots as underscores)
TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.[^.]+\.tmp$")
# the renames of a write_together in progress (.commtune.renames.HOST.PID): present only between its first
# and last rename
JOURNAL = ".commtune.renames"


def _host() -> str:
    return socket.gethostname().replace(".", "_")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host: a zombie (killed, its parent gone and not yet reaped, as MPI ranks
    are for a while after a kill -9 of their launcher) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill's answer stands
    return state not in ("Z", "X")


def _gone(host: str, pid: int) -> bool:
    return host == _host() and not pid_alive(pid)


def remove_stale(folder: str | Path, name: str | None = None) -> list[Path]:
    """Finish a ``write_together`` a kill interrupted in ``folder`` (its renames, all temporary files
    already complete), then remove the temporary files (of target ``name``, or all) whose writer on this
    host is gone; the paths removed."""
    folder = Path(folder)
    for journal in folder.glob(JOURNAL + ".*"):
        host, _, pid = journal.name[len(JOURNAL) + 1:].rpartition(".")
        if not (pid.isdigit() and _gone(host, int(pid))):
            continue
        try:
            for tmp, target in json.loads(journal.read_text()):
                if (folder / tmp).is_file():
                    os.replace(folder / tmp, folder / target)
            journal.unlink()
        except (OSError, ValueError, TypeError):
            pass  # not ours to repair: left as it is
    removed = []
    try:
        entries = list(folder.glob(f".{glob_escape(name)}.*.tmp" if name else ".*.tmp"))
    except OSError:
        return removed
    for p in entries:
        m = TEMP.match(p.name)
        if m and (name is None or m["name"] == name) and _gone(m["host"], int(m["pid"])):
            try:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                removed.append(p)
            except OSError:
                pass
    return removed


def glob_escape(text: str) -> str:
    return re.sub(r"([*?[])", r"[\1]", text)


@contextlib.contextmanager
def staged(path: str | Path, data: str | bytes):
    """A temporary file beside ``path`` holding ``data`` (for a reader that needs a file before ``path`` is
    written: the report of a plan written with it by ``write_together``); removed afterwards."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp(p)
    try:
        _fill(tmp, data.encode() if isinstance(data, str) else data, p)
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_dir(folder: str | Path, name: str):
    """A temporary folder in ``folder`` (named as a temporary file of ``name``, so that ``remove_stale``
    removes it once its writer is gone) for outputs written together before ``replace_dir`` moves them in
    (a full disk fails inside it, the old outputs kept); removed afterwards with what is left in it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.{_host()}.{os.getpid()}.", suffix=".tmp", dir=folder))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(new: Path, target: Path) -> None:
    """The folder ``new`` renamed to ``target``; an old ``target`` is moved into ``new``'s parent's staging
    (``new`` must lie in a ``staged_dir``, which removes it)."""
    if target.exists():
        os.replace(target, new.parent / f"old-{target.name}")
    os.replace(new, target)


def check_utf8(path: str | Path, what: str) -> None:
    """A path whose name is not UTF-8 (a byte Python keeps as a lone surrogate) cannot be shown in a
    report or printed: refused before any work."""
    text = str(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise UserError(f"the {what} path '{shown}' has a byte that is not UTF-8: choose a UTF-8 name") from None


def check_output_path(path: str | Path, what: str = "output", directory: bool = False) -> Path:
    """``path`` as a Path if it can be written (created with its missing folders, or overwritten);
    raise ``UserError`` naming the obstacle otherwise. Creates nothing."""
    p = Path(path)
    if str(path) == "":
        raise UserError(f"the {what} path is empty: give a file name")
    check_utf8(path, what)
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


def _temp(p: Path) -> Path:
    """A new empty temporary file beside ``p`` named for it, this host and this process."""
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.{_host()}.{os.getpid()}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    return Path(tmp)


def _fill(tmp: Path, raw: bytes, like: Path) -> None:
    """``raw`` written to ``tmp`` and synced, with ``like``'s permissions (a new file's: the umask's)."""
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    if like.exists():
        os.chmod(tmp, like.stat().st_mode & 0o7777)
    else:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)


def write_atomic(path: str | Path, data: str | bytes, what: str = "output") -> Path:
    """Write ``data`` to ``path`` whole or not at all (creating missing folders): a temporary file in
    the same folder, synced, then renamed over ``path``. A ``UserError`` names the file when the
    write fails (a full disk: the old file is kept)."""
    return write_together({path: data}, what)[0]


def write_together(files: dict, what: str = "output") -> list[Path]:
    """Write every ``path: data`` of ``files`` (one folder) whole, and all of them or none: every temporary
    file is written and synced before the first rename, and the renames are journalled, so that a kill
    between two renames is finished by the next ``remove_stale`` of the folder (a full disk fails before
    any rename: the old files are kept). The paths written."""
    paths = [check_output_path(p, what) for p in files]
    folder = paths[0].parent
    if any(p.parent != folder for p in paths):
        raise ValueError("write_together writes into one folder")
    temps: list[Path] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale(folder)
        for p, data in zip(paths, files.values()):
            temps.append(_temp(p))
            _fill(temps[-1], data.encode() if isinstance(data, str) else data, p)
        renames = list(zip(temps, paths))
        journal = folder / f"{JOURNAL}.{_host()}.{os.getpid()}"
        if len(paths) > 1:
            _fill(journal, json.dumps([[t.name, p.name] for t, p in renames]).encode(), journal)
            temps = []  # from here on the journal's: finished by the next remove_stale if this stops
        for t, p in renames:
            os.replace(t, p)
        if len(paths) > 1:
            journal.unlink()
        temps = []
        sync_dir(folder)
    except OSError as e:
        names = " and ".join(repr(str(p)) for p in paths)
        raise UserError(f"cannot write the {what} {names} ({e.strerror}): choose a writable path "
                        f"with free space") from None
    finally:
        for t in temps:
            try:
                os.unlink(t)
            except OSError:
                pass
    return paths


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
