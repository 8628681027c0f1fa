"""How many bytes of UTF-8 text each token stands for: what turns a loss per token into bits per
byte, a figure that tokenizers with different vocabularies share.

Byte-level BPE (GPT-2's scheme, ours for GPT) writes every byte as one printable character: the
printable bytes of Latin-1 stand for themselves, and the remaining 68 bytes (controls, space,
and a few others) are written as the characters from U+0100 on, in byte order. Reading a token
back through that alphabet gives its exact bytes. Special and added tokens (end of text) stand
for no text: 0 bytes.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders


def _printable_bytes() -> list[int]:
    return [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte value -> that byte value."""
    printable = _printable_bytes()
    others = [b for b in range(256) if b not in set(printable)]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def token_byte_counts(tokenizer: Tokenizer) -> np.ndarray | None:
    """(vocab,) int64: the UTF-8 bytes of text each token id stands for; None for a tokenizer
    that is not byte-level (a WordPiece vocabulary drops spaces and normalizes text, so its
    tokens have no exact byte count)."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    alphabet = byte_level_alphabet()
    counts = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    added = set(tokenizer.get_added_tokens_decoder())
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if index in added:
            continue  # special tokens: no text
        if any(c not in alphabet for c in token):
            raise ValueError(f"token {token!r} (id {index}) is not in the byte-level alphabet")
        counts[index] = len(token)
    return counts
