"""On-disk cache of trained tokenizers, keyed by corpus fingerprint and training settings, and the
atomic-write helper every cache in the project uses."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer

log = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; on success it is renamed onto `dest` atomically.

    A crash or an exception leaves `dest` as it was (absent or the previous complete file), never
    half written: readers only ever see a complete file.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; give it a normal file's mode
    try:
        yield Path(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def partial_writes(folder: str | os.PathLike, names: str = "*") -> list[Path]:
    """The temporary files of `atomic_path` writes in `folder` whose destinations match
    `names` (a glob): left by a kill before their rename (or of a write still going on)."""
    return sorted(Path(folder).glob(f".{names}.*.tmp"))


def write_text_atomic(dest: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `dest` through `atomic_path`."""
    with atomic_path(dest) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def tokenizers_version() -> str:
    """The `tokenizers` minor version ("0.22"): part of every cache key whose content it makes
    (trained vocabularies, encoded token stores), since its results may change with it."""
    return ".".join(tokenizers.__version__.split(".")[:2])


def cache_key(corpus_fingerprint: str, settings: dict) -> str:
    """Stable key of a tokenizer trained on one corpus with given settings (and the
    `tokenizers` version)."""
    payload = json.dumps(
        {"corpus": corpus_fingerprint, "settings": settings, "tokenizers": tokenizers_version()},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cached_tokenizer_path(cache_dir: str | os.PathLike, kind: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / "tokenizers" / f"{kind}-{key}" / "tokenizer.json"


def read_cached(path: Path) -> Tokenizer | None:
    """The cached tokenizer at `path`, or None when absent or unreadable (then it is rebuilt)."""
    if not path.is_file():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # a corrupt cache entry is rebuilt, never trusted
        log.warning("ignoring unreadable cached tokenizer %s (%s); retraining", path, err)
        return None


def write_cached(tokenizer: Tokenizer, path: Path) -> None:
    with atomic_path(path) as tmp:
        tokenizer.save(str(tmp))
