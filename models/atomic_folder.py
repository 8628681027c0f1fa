"""Replacing a folder whole: readers see either its old files or all of the new ones, never a
mix (models/hf.py writes a Hugging Face export this way, with `write_folder`).

The new files are written into a staging folder beside the target (`staged_folder`), and
`replace_folder` swaps it in: with one atomic exchange of the two names where the file system
offers it (Linux `renameat2(RENAME_EXCHANGE)`: ext4, xfs, btrfs, tmpfs, overlayfs), else with
renames (NFS): the staging folder, its files on disk, is renamed `<staging>-ready` (a complete
copy), the old folder `<staging>-old`, and the ready copy takes the target's name. A kill
between the last two leaves no folder under the target name, both copies beside it: the next
write (or `write_folder`'s check) first puts the ready copy back under the name (the `-old`
one, where an earlier version marked none ready), and only then removes the other leftovers
of killed writes. Files of the old folder that the new one does not hold are kept
(hard-linked into it), so a file a user put there is not lost.

`write_folder` first reads whether the folder holds its files already (their bytes, and the
tensors of safetensors files one at a time), so that rewriting an unchanged folder writes
nothing, not even a staging copy (on a nearly full disk, say).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = ["recover_folder", "replace_folder", "staged_folder", "write_folder"]

log = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# the names of a staging folder swapped in by renames: a complete new copy, the old folder, and
# the old folder once its removal began (no longer complete)
_READY, _OLD, _GONE = "-ready", "-old", "-gone"
_METADATA = {"format": "pt"}  # what `transformers` looks for in a safetensors file


def _staging_prefix(directory: Path) -> str:
    return f".{directory.name}.staged-"


def write_folder(
    directory: str | os.PathLike,
    files: Mapping[str, bytes],
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    save: Callable[..., None] = save_file,
) -> bool:
    """Make `directory` hold `files` (name -> bytes) and safetensors files (name -> their
    tensors, written by `save`, which takes `save_file`'s arguments), replaced whole
    (`replace_folder`); other files of `directory` are kept. Returns whether anything was
    written: False when `directory` held them all already (found by reading it, without
    writing anything).

    Raises:
        OSError: a file could not be written (a full disk is ENOSPC, also where safetensors
            says so in words); `directory` is then left as it was.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file; give a folder to write into")
    directory.parent.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(directory)
    if _holds(directory, files, tensors):
        return False
    with staged_folder(directory) as staging:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        for name, named in tensors.items():
            path = staging / name
            path.touch()  # with the mode a new file gets under the umask
            mode = stat.S_IMODE(path.stat().st_mode)
            _save_tensors(save, named, path)
            os.chmod(path, mode)  # safetensors makes its file private (0600)
        replace_folder(staging, directory)
    return True


def recover_folder(directory: str | os.PathLike) -> Path | None:
    """Where a swap by renames was killed between them (no `directory`; its complete copies
    beside it), put the complete one back under the name: the new copy marked ready, else the
    old one. Returns the leftover put back (None: there was nothing to put back)."""
    directory = Path(directory)
    if directory.exists() or directory.is_symlink() or not directory.parent.is_dir():
        return None
    leftovers = sorted(directory.parent.glob(f"{_staging_prefix(directory)}*"))
    for mark in (_READY, _OLD):
        complete = [path for path in leftovers if path.name.endswith(mark)]
        if complete:
            complete[-1].rename(directory)
            _sync_folder(directory.parent)
            log.warning(
                "%s was missing (a write of it was killed between two renames): put back %s",
                directory,
                complete[-1].name,
            )
            return complete[-1]
    return None


def _clear_leftovers(directory: Path) -> None:
    """Put back a complete copy where the target is missing (`recover_folder`), then remove
    what killed writes of `directory` left beside it."""
    recover_folder(directory)
    for leftover in directory.parent.glob(f"{_staging_prefix(directory)}*"):
        log.info("removing %s, left by an interrupted write of %s", leftover, directory)
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(directory: str | os.PathLike) -> Iterator[Path]:
    """An empty folder beside `directory` (its mode the one a new folder gets under the
    umask) to write the new files into, then give to `replace_folder`; removed when the block
    ends (holding the old files, after a swap). What killed writes left beside `directory`
    is cleared before (`_clear_leftovers`, by `write_folder`)."""
    directory = Path(directory)
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


def replace_folder(staging: Path, directory: str | os.PathLike) -> None:
    """Put the files of `staging` under the name `directory`, whole (`write_folder` has found
    that `directory` does not hold them already). Files of the old `directory` that `staging`
    lacks are kept."""
    directory = Path(directory)
    if directory.is_dir():
        _keep_the_others(directory, staging)
    _sync_folder(staging, files=True)
    # after an exchange, `staging` holds the old files, which `staged_folder` removes
    if not (directory.exists() and _exchange(staging, directory)):
        _swap_by_renames(staging, directory)
    _sync_folder(directory.parent)
    return True


def _swap_by_renames(staging: Path, directory: Path) -> None:
    """`staging` (its files on disk) under the name `directory`, by renames that name each
    leftover for what it holds, should a kill come between them (`recover_folder`)."""
    ready = staging.rename(staging.with_name(f"{staging.name}{_READY}"))
    _sync_folder(directory.parent)  # marked complete on disk before the old copy leaves the name
    old = staging.with_name(f"{staging.name}{_OLD}")
    if directory.exists():
        directory.rename(old)
    ready.rename(directory)
    if old.exists():
        shutil.rmtree(old.rename(old.with_name(f"{staging.name}{_GONE}")), ignore_errors=True)


def _holds(
    directory: Path,
    files: Mapping[str, bytes],
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
) -> bool:
    """Whether `directory` holds `files`, byte for byte, and safetensors files of `tensors`,
    bit for bit, read one tensor at a time."""
    try:
        if any((directory / name).read_bytes() != data for name, data in files.items()):
            return False
        return all(_holds_tensors(directory / name, named) for name, named in tensors.items())
    except (OSError, SafetensorError):  # missing, unreadable, cut short
        return False


def _holds_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> bool:
    with safe_open(path, framework="pt") as stored:
        if stored.metadata() != _METADATA or set(stored.keys()) != set(tensors):
            return False
        for name, tensor in tensors.items():
            found = stored.get_tensor(name)
            if found.dtype != tensor.dtype or found.shape != tensor.shape:
                return False
            if not torch.equal(_bits(found), _bits(tensor)):  # equal NaNs too
                return False
    return True


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _save_tensors(
    save: Callable[..., None], tensors: Mapping[str, torch.Tensor], path: Path
) -> None:
    """`save` (`save_file`), whose failure to write (a full disk) is an OSError with its errno."""
    try:
        save(dict(tensors), path, metadata=_METADATA)
    except SafetensorError as err:  # "... I/O error: No space left on device (os error 28)"
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from err


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
