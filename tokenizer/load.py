"""Load an existing tokenizer: a `tokenizer.json`, a BERT `vocab.txt`, a folder holding one of
them, or (online only) a Hugging Face hub name."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tokenizers import Tokenizer, models

from tokenizer.build import add_bert_template, wordpiece_pipeline
from tokenizer.special import UNK

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class TokenizerLoadError(FileNotFoundError):
    """A tokenizer could not be loaded; the message says where it looked and what to do."""


def load_tokenizer(path: str | os.PathLike, lowercase: bool = True) -> Tokenizer:
    """Load a tokenizer from a local path or, when online, a hub name.

    Args:
        path: a `tokenizer.json`, a WordPiece `vocab.txt` (one token per line), a directory
            with either, or a hub repository id such as `bert-base-uncased`.
        lowercase: for a `vocab.txt`, whether the vocabulary is uncased.

    Raises:
        TokenizerLoadError: nothing loadable at `path`, or the hub cannot be reached.
    """
    local = Path(path).expanduser()
    if local.is_dir():
        for name in ("tokenizer.json", "vocab.txt"):
            if (local / name).is_file():
                return load_tokenizer(local / name, lowercase)
        raise TokenizerLoadError(
            f"tokenizer.path={str(path)!r} is a directory without tokenizer.json or vocab.txt; "
            "point it at one of those files"
        )
    if local.is_file():
        return _load_file(local, lowercase)
    if _looks_like_hub_id(str(path)):
        return _load_from_hub(str(path))
    raise TokenizerLoadError(
        f"tokenizer.path={str(path)!r} does not exist; point it at a tokenizer.json, a "
        "vocab.txt or a directory holding one, or set tokenizer.path=null to train a new one"
    )


def _load_file(path: Path, lowercase: bool) -> Tokenizer:
    try:
        if path.suffix == ".txt":
            vocab = models.WordPiece.read_file(str(path))
            if UNK not in vocab:
                raise TokenizerLoadError(f"{path}: a WordPiece vocab.txt must contain {UNK}")
            tokenizer = wordpiece_pipeline(models.WordPiece(vocab, unk_token=UNK), lowercase)
            return add_bert_template(tokenizer)
        return Tokenizer.from_file(str(path))
    except TokenizerLoadError:
        raise
    except Exception as err:  # tokenizers raises plain Exceptions for malformed files
        raise TokenizerLoadError(
            f"{path} is not a valid tokenizer file ({err}); expected a tokenizers "
            "tokenizer.json or a vocab.txt with one token per line"
        ) from err


def _looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and not text.endswith((".json", ".txt"))


def _load_from_hub(name: str) -> Tokenizer:
    offline = [v for v in _OFFLINE_VARS if os.environ.get(v, "").lower() in ("1", "true", "yes")]
    if offline:
        raise TokenizerLoadError(
            f"tokenizer.path={name!r} is not a local file, and {offline[0]} is set so the "
            "Hugging Face hub is not contacted; download the tokenizer on a machine with "
            "network and set tokenizer.path to the local tokenizer.json or vocab.txt"
        )
    try:
        return Tokenizer.from_pretrained(name)
    except Exception as err:
        raise TokenizerLoadError(
            f"tokenizer.path={name!r} is not a local file, and loading it from the Hugging Face "
            f"hub failed ({err}); check the name, or download it and give the local path"
        ) from err
