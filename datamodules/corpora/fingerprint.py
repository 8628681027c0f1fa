"""The fingerprint of a corpus, which keys the tokenizer and token-store caches: every field of a
corpus is in it unless declared `_NOT_IN_KEY` with the reason, so a new setting keys the caches
without anyone remembering to add it (`data.errors` was once forgotten, and a cache built with
`errors=replace` was reused by an `errors=skip` run), and so is what identifies the text read: for
local files their path, size and a digest of their bytes or their modification time
(`_files_key`, as `change_detection` says)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from typing import Literal

ChangeDetection = Literal["auto", "content", "stat"]
# Field metadata key of the settings that cannot change the documents read, mapped to the reason;
# every other field is part of the fingerprint (`_fingerprint`).
_NOT_IN_KEY = "not_in_key"
# Field metadata key of settings added after corpora were cached: in the key only when set, so
# that the caches of corpora read without them keep their keys.
_KEY_WHEN_SET = "key_when_set"
# `change_detection=auto` hashes the files' bytes while they total at most this, else stats
# them. `_file_digest` (sha256) reads 1.1-1.6 GB/s on one core of the shared 2-core AMD EPYC
# development machine, from the page cache (blake2b 0.8-1.0, md5 0.5; a 256 MiB file timed in
# 1, 4 and 8 MiB chunks, Nov 2026): about a second per process at this size, once per run
# (`digests`). A cold read from disk is slower, at the disk's speed.
AUTO_CONTENT_LIMIT = 1 << 30
_HASH_CHUNK = 4 << 20


def _hash(*parts: object) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def _fingerprint(corpus: object, content: object) -> str:
    """The fingerprint of `corpus`: its type, every field not declared `_NOT_IN_KEY`, and
    `content`, what identifies the text read (file stats, a dataset fingerprint, ...)."""
    settings = {
        f.name: getattr(corpus, f.name)
        for f in fields(corpus)
        if _NOT_IN_KEY not in f.metadata
        and not (f.metadata.get(_KEY_WHEN_SET) and getattr(corpus, f.name) is None)
    }
    return _hash(type(corpus).__name__, settings, content)


def _files_key(
    paths: list[str], mode: ChangeDetection = "auto", digests: dict | None = None
) -> list[list]:
    """What identifies the content of `paths`, in reading order: each file's absolute path and
    size, and a sha256 digest of its bytes (`mode="content"`) or its modification time
    (`"stat"`; an edit that keeps the size and restores the mtime, as `cp -p` or `rsync -t`
    of a changed file does, goes unnoticed). `"auto"` hashes while the files total at most
    `AUTO_CONTENT_LIMIT` bytes. `digests` memoizes digests by file stat, so that the several
    fingerprints a run takes read each file once."""
    digests = {} if digests is None else digests
    stats = [os.stat(path) for path in paths]
    if mode == "auto":
        mode = "content" if sum(st.st_size for st in stats) <= AUTO_CONTENT_LIMIT else "stat"
    keys: list[list] = []
    for path, st in zip(paths, stats, strict=True):
        identity: int | str = st.st_mtime_ns
        if mode == "content":
            # any write or utime changes the ctime; the inode tells a replaced file apart
            memo = (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
            if memo not in digests:
                digests[memo] = _file_digest(path)
            identity = digests[memo]
        keys.append([os.path.abspath(path), st.st_size, identity])
    return keys


def _file_digest(path: str) -> str:
    """sha256 of a file's bytes (as stored: a .gz file's compressed bytes)."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while size := handle.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()
