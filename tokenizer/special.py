"""Special tokens of the two tokenizer kinds, and their ids in a given tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer, processors

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

    @property
    def document_separator(self) -> int:
        """The id that ends one document and starts the next in a causal model's stream: the
        end-of-text token, or [SEP] for a WordPiece tokenizer (which has none)."""
        separator = self.eot if self.eot is not None else self.sep
        if separator is None:
            raise MissingSpecialTokensError("the tokenizer has neither an end-of-text nor [SEP]")
        return separator

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


@dataclass(frozen=True)
class InputTemplate:
    """The special tokens around the texts of one example, as a model family reads them:
    `lead` before the first text, `close` after each text; `segments`: the second text's tokens
    get segment id 1 (BERT's token types), else every token 0.

    BERT: `[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]`; GPT: `A <eot>` and `A <eot> B <eot>`.
    """

    lead: tuple[str, ...]
    close: str
    segments: bool

    def special_count(self, texts: int) -> int:
        """How many special tokens an example of `texts` texts carries."""
        return len(self.lead) + texts

    def wrap_ids(self, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
        """The ids put before and after a text (one chunk of a long document)."""
        return [tokenizer.token_to_id(t) for t in self.lead], [tokenizer.token_to_id(self.close)]

    def apply(self, tokenizer: Tokenizer) -> Tokenizer:
        """Set `tokenizer`'s post-processor to this template (in place) and return it."""
        second = 1 if self.segments else 0
        lead = "".join(f"{t}:0 " for t in self.lead)
        tokens = {t: tokenizer.token_to_id(t) for t in (*self.lead, self.close)}
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{lead}$A:0 {self.close}:0",
            pair=f"{lead}$A:0 {self.close}:0 $B:{second} {self.close}:{second}",
            special_tokens=list(tokens.items()),
        )
        return tokenizer


WORDPIECE_TEMPLATE = InputTemplate(lead=(CLS,), close=SEP, segments=True)
BPE_TEMPLATE = InputTemplate(lead=(), close=EOT, segments=False)
# The template a tokenizer of each kind is made with (a family may name another).
TEMPLATE_BY_KIND = {"wordpiece": WORDPIECE_TEMPLATE, "bpe": BPE_TEMPLATE}
