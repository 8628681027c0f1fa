"""A checkpoint save that found no space left: one error that says where, how much, and what is
intact, instead of torch's traceback (which ends in `unexpected pos ...` or `basic_ios::clear:
iostream error`, naming neither the disk nor the file).

torch reports a full disk as a RuntimeError without an errno, so a failed save is taken for a
full disk when the system says so (ENOSPC, EDQUOT) or when the file system had less free space
than the checkpoint needs as the save began (`free_space`, measured then: after the failure the
partial file may still be open, and hold its space, until the error is handled).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.source import newest_checkpoint
from pipeline.run.errors import DiskFullError

__all__ = ["checkpoint_bytes", "disk_full_error", "file_system", "free_space"]

_NO_SPACE = {errno.ENOSPC: "no space left", errno.EDQUOT: "the disk quota is used up"}


def checkpoint_bytes(checkpoint: Any) -> int:
    """The bytes of the tensors in a checkpoint's contents (what its file needs, less a few
    kilobytes of pickled plain data); a storage shared by several tensors counts once."""
    seen: dict[int, int] = {}
    stack = [checkpoint]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return sum(seen.values())


def file_system(path: Path) -> str:
    """The mount point holding `path`, with the file system's type and source where the system
    lists them (`/mnt/scratch (ext4 /dev/nvme0n1p2)`)."""
    mount = Path(os.path.abspath(path))
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        with open("/proc/self/mounts") as handle:
            listed = [line.split() for line in handle]
    except OSError:  # not Linux
        return str(mount)
    found = [f for f in listed if len(f) >= 3 and f[1].replace("\\040", " ") == str(mount)]
    if not found:
        return str(mount)
    kind, source = found[-1][2], found[-1][0]
    return f"{mount} ({kind})" if source == kind else f"{mount} ({kind} {source})"


def free_space(path: Path) -> int:
    """The bytes free for this user on the file system that `path` (which may not exist
    yet) is or will be written to."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def disk_full_error(
    path: Path, checkpoint: dict[str, Any], err: BaseException, free: int
) -> DiskFullError | None:
    """The error to raise for a failed save of `checkpoint` to `path` (a run's
    `checkpoints/<name>.ckpt`) that began with `free` bytes free there (`free_space`), when
    the failure was for want of space; None otherwise."""
    needed = checkpoint_bytes(checkpoint)
    reason = _NO_SPACE.get(getattr(err, "errno", None))
    if reason is None and free >= needed:
        return None
    intact = newest_checkpoint(path.parent.parent)
    if intact is None:
        kept = "there is no earlier checkpoint of the run (resuming starts it afresh)"
    else:
        step = intact.contents.get("global_step")
        kept = f"its newest complete checkpoint, {intact.path.name} (step {step}), is intact"
    step = checkpoint.get("global_step")
    return DiskFullError(
        f"{reason or 'no space left'} on {file_system(path.parent)} to save {path.name} at step "
        f"{step}: it needs about {_megabytes(needed)}, {_megabytes(free)} were free as it began; "
        f"{kept}. "
        "Free space on that disk"
    )


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB"
