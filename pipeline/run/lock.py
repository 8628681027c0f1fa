"""One run at a time in a run folder.

Two commands writing one folder (two `make pretrain run_name=x` started together, a fine-tune
started twice under one name) would mix their checkpoints, interleave their logs and overwrite
each other's record. So the first process of a run (`pipeline.run.folder.first_process`) takes the
folder's lock before anything is written there, and holds it until it exits; a second command
for the same folder stops with one line naming the owner's pid and host.

The lock is `<run dir>/.run.lock`, held with `flock`: the kernel releases it when the owner
exits in any way (SIGKILL, a crash, a node that reboots, on file systems whose locks are
shared between machines: local disks, NFSv4, Lustre mounted with `flock`), so a lock is never
left held by a process that is gone. The file names its owner (pid, host, command, start time)
while the lock is held and is emptied when the owner releases it; a file that still names an
owner whose lock is free was left by a run that was killed, which the next run reports as it
takes the folder over. The file itself is never deleted while the folder is in use: deleting a
locked file would let a third process lock a new file of the same name.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from pipeline.run.errors import RunFolderBusyError

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"


@dataclass(frozen=True)
class LockOwner:
    """Who holds (or last held) a run folder's lock."""

    pid: int
    host: str
    command: str
    since: str

    @classmethod
    def this_process(cls, command: str) -> LockOwner:
        stamp = datetime.now().isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), command, stamp)

    @classmethod
    def read(cls, handle) -> LockOwner | None:
        """The owner the open lock file names, or None when it names none (free, or torn)."""
        handle.seek(0)
        try:
            return cls(**json.loads(handle.read() or "null"))
        except (TypeError, ValueError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} (make {self.command}, since {self.since})"


class RunLock:
    """The held lock of one run folder; `release()` (also run at exit) frees it."""

    def __init__(self, path: Path, handle) -> None:
        self.path = path
        self._handle = handle

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        with contextlib.suppress(OSError):  # the folder may have been removed
            handle.truncate(0)
            handle.flush()
        handle.close()  # closing the last descriptor frees the flock


_held: dict[Path, RunLock] = {}


def lock_run_folder(run_dir: Path, command: str, other: str = "run_name=") -> RunLock:
    """Take `run_dir`'s lock for this process (the folder is made if missing); a second call
    for the same folder returns the lock already held. `other`: the key that names another
    folder, in the fix of a refusal.

    Raises:
        RunFolderBusyError: another process holds it; names that process and what to do.
    """
    path = (run_dir / LOCK_FILE).absolute()
    if path in _held:
        return _held[path]
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held until exit)
    try:
        if not _try_flock(handle):
            owner = _wait_for_owner(handle)
            handle.close()
            who = owner.describe() if owner else "another process (it has not named itself yet)"
            stop = (
                f"stop it (kill {owner.pid}), "
                if owner and owner.host == socket.gethostname()
                else ""
            )
            raise RunFolderBusyError(
                f"{run_dir} is in use by {who}; wait for that run to end, {stop}or choose "
                f"another {other}"
            )
        previous = LockOwner.read(handle)
        if previous is not None:
            log.warning(
                "taking over %s: its last owner, %s, ended without releasing it (killed or "
                "crashed); its files are kept, and a pretraining run continues from them with "
                "resume=auto",
                run_dir,
                previous.describe(),
            )
        handle.seek(0)
        handle.truncate(0)
        json.dump(asdict(LockOwner.this_process(command)), handle)
        handle.flush()
        os.fsync(handle.fileno())
    except BaseException:
        if not handle.closed:
            handle.close()
        raise
    lock = _held[path] = RunLock(path, handle)
    return lock


def release_run_folder(run_dir: Path) -> None:
    """Free `run_dir`'s lock if this process holds it."""
    lock = _held.pop((run_dir / LOCK_FILE).absolute(), None)
    if lock is not None:
        lock.release()


def _try_flock(handle) -> bool:
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:  # a file system without locks: run unguarded rather than not at all
        if err.errno not in (errno.ENOLCK, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        log.warning(
            "%s: the file system does not support locks (%s); runs into this folder "
            "are not guarded against each other",
            handle.name,
            err,
        )
    return True


def _wait_for_owner(handle, seconds: float = 2.0) -> LockOwner | None:
    """The owner named in a busy lock file (it writes its name just after locking)."""
    deadline = time.monotonic() + seconds
    while (owner := LockOwner.read(handle)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return owner


@atexit.register
def release_all() -> None:
    """Free every lock this process holds: at exit, and after each command a test runs in its
    own process (`tests/in_process.py`), as the command's own process would have ended."""
    for path in list(_held):
        _held.pop(path).release()
