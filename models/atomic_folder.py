"""Replacing a folder whole: readers see either its old files or all of the new ones, never a
mix (models/hf.py writes a Hugging Face export this way).

The new files are written into a staging folder beside the target (`staged_folder`), and
`replace_folder` swaps it in: with one atomic exchange of the two names where the file system
offers it (Linux `renameat2(RENAME_EXCHANGE)`: ext4, xfs, btrfs, tmpfs, overlayfs), else with
two renames, between which a kill leaves no folder under the target name (and both copies
beside it). Files of the old folder that the new one does not hold are kept (hard-linked into
it), so a file a user put there is not lost. A staging folder left by a killed write is
removed by the next write of the same target.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import filecmp
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replace_folder", "staged_folder"]

log = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _staging_prefix(directory: Path) -> str:
    return f".{directory.name}.staged-"


@contextlib.contextmanager
def staged_folder(directory: str | os.PathLike) -> Iterator[Path]:
    """An empty folder beside `directory` (its mode the one a new folder gets under the
    umask) to write the new files into, then give to `replace_folder`; removed when the block
    ends (holding the old files, after a swap). The staging folders of earlier writes of
    `directory` that were killed are removed first."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file; give a folder to write into")
    directory.parent.mkdir(parents=True, exist_ok=True)
    for leftover in directory.parent.glob(f"{_staging_prefix(directory)}*"):
        log.info("removing %s, left by an interrupted write of %s", leftover, directory)
        shutil.rmtree(leftover, ignore_errors=True)
    while True:
        staging = directory.with_name(f"{_staging_prefix(directory)}{secrets.token_hex(4)}")
        try:
            staging.mkdir()
            break
        except FileExistsError:
            continue
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def replace_folder(staging: Path, directory: str | os.PathLike) -> bool:
    """Put the files of `staging` under the name `directory`, whole; returns whether anything
    changed (False: `directory` already held the same files, byte for byte and mode for mode,
    and is left untouched). Files of the old `directory` that `staging` lacks are kept."""
    directory = Path(directory)
    if directory.is_dir() and _holds_the_same(directory, staging):
        return False
    if directory.is_dir():
        _keep_the_others(directory, staging)
    _sync_folder(staging, files=True)
    # after an exchange, `staging` holds the old files, which `staged_folder` removes
    if not (directory.exists() and _exchange(staging, directory)):
        old = staging.with_name(f"{staging.name}-old")  # a leftover's name, should a kill come
        if directory.exists():
            directory.rename(old)
        staging.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    _sync_folder(directory.parent)
    return True


def _holds_the_same(directory: Path, staging: Path) -> bool:
    for new in staging.iterdir():
        old = directory / new.name
        if not old.is_file() or old.is_symlink():
            return False
        if stat.S_IMODE(old.stat().st_mode) != stat.S_IMODE(new.stat().st_mode):
            return False
        if not filecmp.cmp(old, new, shallow=False):
            return False
    return True


def _keep_the_others(directory: Path, staging: Path) -> None:
    """Hard-link (copy, where links are refused) what `directory` holds and `staging` does not
    into `staging`."""
    for entry in directory.iterdir():
        target = staging / entry.name
        if target.exists() or target.is_symlink():
            continue
        if entry.is_symlink():
            target.symlink_to(os.readlink(entry))
        elif entry.is_dir():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, target)


def _link_or_copy(source: str | os.PathLike, target: str | os.PathLike) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two names atomically; False where the system or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or a C library without it
        return False
    done = renameat2(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. NFS
        return False
    raise OSError(code, os.strerror(code), str(second))


def _sync_folder(folder: Path, *, files: bool = False) -> None:
    """fsync a folder's entries (and with `files`, its files' contents first), so that a
    crash after the rename cannot leave the new name pointing at unwritten data."""
    for path in folder.rglob("*") if files else ():
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    with contextlib.suppress(OSError):  # not every system opens a folder for fsync
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
