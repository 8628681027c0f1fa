"""Special tokens of the two tokenizer kinds, and their ids in a given tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
WORDPIECE_SPECIALS = (PAD, UNK, CLS, SEP, MASK)  # [PAD] first so that its id is 0, as in BERT
EOT = "<|endoftext|>"
BPE_SPECIALS = (EOT,)

SPECIALS_BY_KIND = {"wordpiece": WORDPIECE_SPECIALS, "bpe": BPE_SPECIALS}
# A tokenizer's kind follows from its `tokenizers` model type, so it is never passed beside it.
KIND_OF_MODEL = {"WordPiece": "wordpiece", "BPE": "bpe"}


class MissingSpecialTokensError(ValueError):
    """A loaded tokenizer does not have the special tokens this pipeline needs."""


class UnsupportedTokenizerError(ValueError):
    """A tokenizer's model type is neither WordPiece nor BPE, or not the kind a run needs."""


@dataclass(frozen=True)
class SpecialIds:
    """Ids the data pipeline and models need. For BPE, padding reuses the end-of-text id."""

    pad: int
    unk: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    eot: int | None = None

    def all(self) -> set[int]:
        return {v for v in vars(self).values() if v is not None}

    def ordered(self) -> tuple[int, ...]:
        """Every special id, ascending (the ids a pair's token alignment leaves out)."""
        return tuple(sorted(self.all()))


def tokenizer_kind(tokenizer: Tokenizer) -> str:
    """The kind of `tokenizer`, "wordpiece" or "bpe", read from its `tokenizers` model type.

    Raises:
        UnsupportedTokenizerError: the tokenizer is of another model type (Unigram, WordLevel).
    """
    model_type = type(tokenizer.model).__name__
    if model_type not in KIND_OF_MODEL:
        raise UnsupportedTokenizerError(
            f"the tokenizer is a {model_type} model; only WordPiece (BERT) and BPE (GPT) "
            "tokenizers are supported"
        )
    return KIND_OF_MODEL[model_type]


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """Look up the special-token ids of a tokenizer, by its kind (`tokenizer_kind`).

    Raises:
        UnsupportedTokenizerError: the tokenizer is neither WordPiece nor BPE.
        MissingSpecialTokensError: a required special token is missing from the vocabulary.
    """
    kind = tokenizer_kind(tokenizer)
    missing = [t for t in SPECIALS_BY_KIND[kind] if tokenizer.token_to_id(t) is None]
    if missing:
        raise MissingSpecialTokensError(
            f"the {kind} tokenizer lacks special token(s) {missing}; a {kind} tokenizer for this "
            f"pipeline needs {list(SPECIALS_BY_KIND[kind])} (train one with tokenizer.path=null)"
        )
    ids = {t: tokenizer.token_to_id(t) for t in SPECIALS_BY_KIND[kind]}
    if kind == "wordpiece":
        return SpecialIds(pad=ids[PAD], unk=ids[UNK], cls=ids[CLS], sep=ids[SEP], mask=ids[MASK])
    return SpecialIds(pad=ids[EOT], eot=ids[EOT])
