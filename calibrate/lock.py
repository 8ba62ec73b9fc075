"""One writer per output directory: a lock file naming the host and process that holds it.

    with DirLock(Path("results/calib-1"), "results directory"):
        ...   # a second writer gets a UserError naming the holder

The lock file (``.commtune.lock`` in the directory) is created exclusively and holds
``host pid started``. A lock left by a process that no longer runs on this host
(a kill -9) is stale and taken over; one held by another host is reported with the
file to remove if that job is gone. Taking the lock finishes or removes what a killed writer left in
the directory (``calibrate.outputs.remove_stale``)."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from calibrate.errors import UserError
from calibrate.outputs import check_utf8, pid_alive, remove_stale

LOCK_NAME = ".commtune.lock"
# a lock file still empty after this long was left by a writer killed between creating and filling it
EMPTY_STALE_S = 10.0


class DirLock:
    """An exclusive lock on ``folder`` for this process (reentrant: acquiring it twice is a no-op)."""

    def __init__(self, folder: str | Path, what: str = "output directory"):
        self.folder, self.what = Path(folder), what
        self.path = self.folder / LOCK_NAME
        self.held = False

    def holder(self) -> tuple[str, int, float] | None:
        """(host, pid, start time) written in the lock file; None when it is empty or unreadable."""
        try:
            host, pid, started = self.path.read_text().split()
            return host, int(pid), float(started)
        except (OSError, ValueError):
            return None

    def _stale(self) -> bool:
        who = self.holder()
        if who is None:
            try:
                return time.time() - self.path.stat().st_mtime > EMPTY_STALE_S
            except OSError:
                return True
        host, pid, _ = who
        return host == socket.gethostname() and not pid_alive(pid)

    def _unwritable(self, e: OSError) -> UserError:
        return UserError(f"cannot lock the {self.what} {str(self.folder)!r} ({e.strerror}): choose a writable "
                         f"directory")

    def acquire(self) -> "DirLock":
        if self.held:
            return self
        check_utf8(self.folder, self.what)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise UserError(f"the {self.what} {str(self.folder)!r} is a file, not a directory: choose another "
                            f"path") from None
        except OSError as e:
            raise self._unwritable(e) from None
        for _ in range(3):
            if self.path.is_dir() or self.path.exists() and not self.path.is_file():
                raise UserError(f"the lock file {str(self.path)!r} of the {self.what} is not a file (a directory "
                                f"or another object): remove it and run again")
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._stale():
                    try:
                        self.path.unlink()
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        raise self._unwritable(e) from None
                    continue
                who = self.holder()
                by = (f"process {who[1]} on {who[0]} since {time.strftime('%H:%M:%S', time.localtime(who[2]))}"
                      if who else "another process")
                raise UserError(f"the {self.what} {str(self.folder)!r} is in use by {by}: wait for it to "
                                f"finish or choose another; if that process is gone, remove {str(self.path)!r}")
            except OSError as e:  # a read-only folder or file system, a full disk
                raise self._unwritable(e) from None
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(f"{socket.gethostname()} {os.getpid()} {time.time():.0f}\n")
            except OSError as e:
                self.path.unlink(missing_ok=True)
                raise self._unwritable(e) from None
            self.held = True
            remove_stale(self.folder)  # what a killed writer left here: its renames finished, its temporaries removed
            return self
        raise UserError(f"cannot lock the {self.what} {str(self.folder)!r}: its lock file keeps changing; "
                        f"choose another")

    def release(self) -> None:
        if not self.held:
            return
        who = self.holder()
        if who and who[0] == socket.gethostname() and who[1] == os.getpid():
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self.held = False

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
