"""One run per run folder: an exclusive lock, held while a run writes there.

Two runs on one folder would interleave their checkpoints, metrics and summary (each
rotating away the other's checkpoints). The lock is ``fcntl.flock`` on the folder's
``.lock`` file, which the kernel releases however its holder ends, SIGKILL included, so
a stale lock never blocks a later run. The file records the holder (pid, host, start
time) for the error a second run gets. flock holds across machines on a shared file
system that supports it (NFSv4, Lustre mounted with ``flock``); elsewhere it is local.

``par4d train`` takes the lock in the launching process, before any rank starts, and
tells its ranks so (:data:`HELD_ENV`); under torchrun or srun rank 0 takes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path

from par4d.folder import Folder

LOCK = ".lock"
HELD_ENV = "PAR4D_RUN_LOCK_HELD"    # the run folder (absolute) whose lock the launching process holds


def check_new_out(out: Path) -> None:
    """A new run's folder: missing, or empty but for a lock (left by a run that ended before writing
    anything, or held by this very launch)."""
    if out.is_symlink() and not out.exists():
        raise ValueError(f"--out {out} is a symbolic link to nothing; give a folder for the run")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the run (nothing is overwritten)")
    if out.exists() and any(p.name != LOCK for p in out.iterdir()):
        raise ValueError(f"--out {out} already holds files; pass --resume {out} to continue that run, "
                         f"or choose another --out (nothing is overwritten)")


class RunLock:
    """The lock of run folder ``run`` (created if missing), taken without waiting; ``release``
    (or leaving the ``with`` block) gives it back. ``new``: the run starts there, so once the lock
    is held the folder must still hold nothing but it (another run may have written there since
    the folder was checked before launch)."""

    def __init__(self, run: str | Path, new: bool = False):
        self.run = Path(run)
        fd = Folder(self.run).open_rw(LOCK)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise ValueError(f"{self.run} is in use by another par4d run ({holder}); wait for it to end, "
                             f"or give another folder (nothing was written)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd: int | None = fd
        if new:
            try:
                check_new_out(self.run)
            except ValueError:
                self.release()
                raise

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def held_by_launcher(run: str | Path) -> bool:
    """Whether the process that launched this rank holds ``run``'s lock (``par4d train``'s ranks)."""
    held = os.environ.get(HELD_ENV)
    return held is not None and Path(held) == Path(run).resolve()
