"""Build and train the two tokenizer kinds with `tokenizers`.

- WordPiece (BERT): BERT normalizer (lower-casing by default), BERT pre-tokenizer, `##` subwords,
  `[CLS] A [SEP] B [SEP]` post-processing with token types 0/1, WordPiece decoder.
- Byte-level BPE (GPT): every byte is in the base alphabet, so no text is ever unknown, and the
  byte-level decoder gives back exactly the UTF-8 text that was encoded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from tokenizer.special import SPECIALS_BY_KIND, UNK, WORDPIECE_TEMPLATE


def wordpiece_pipeline(model: models.WordPiece, lowercase: bool) -> Tokenizer:
    """A BERT tokenizer around a (trained or loaded) WordPiece model, without post-processor."""
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def add_bert_template(tokenizer: Tokenizer) -> Tokenizer:
    """Post-process single texts as `[CLS] A [SEP]` and pairs as `[CLS] A [SEP] B [SEP]`."""
    return WORDPIECE_TEMPLATE.apply(tokenizer)


def bytelevel_bpe_pipeline() -> Tokenizer:
    """An untrained byte-level BPE tokenizer (no prefix space, so decoding is exact)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class EmptyCorpusError(ValueError):
    """The corpus yielded no text to train on."""


def train_tokenizer(
    kind: str,
    batches: Iterator[list[str]],
    vocab_size: int,
    min_frequency: int = 2,
    lowercase: bool = True,
) -> Tokenizer:
    """Train a `kind` ("wordpiece" or "bpe") tokenizer from batches of documents.

    The texts are streamed: only word counts are kept in memory, never the corpus.

    Raises:
        EmptyCorpusError: the corpus has no text.
    """
    specials = list(SPECIALS_BY_KIND[kind])
    if kind == "wordpiece":
        tokenizer = wordpiece_pipeline(models.WordPiece(unk_token=UNK), lowercase)
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            continuing_subword_prefix="##",
            show_progress=False,
        )
    else:
        tokenizer = bytelevel_bpe_pipeline()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    seen = _CountingIterator(batches)
    tokenizer.train_from_iterator(seen, trainer=trainer)
    if seen.characters == 0:
        raise EmptyCorpusError(
            "the corpus is empty (no non-blank text): check data.paths and that the files hold "
            "text, or use the default corpus (data=embedded)"
        )
    if kind == "wordpiece":
        add_bert_template(tokenizer)
    return tokenizer


def batched(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    """Group texts into lists of `size` (the last may be shorter) for batched training/encoding."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class _CountingIterator:
    """Pass batches through while counting characters, to detect an empty corpus."""

    def __init__(self, batches: Iterator[list[str]]) -> None:
        self._batches = iter(batches)
        self.characters = 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> list[str]:
        batch = next(self._batches)
        self.characters += sum(len(t.strip()) for t in batch)
        return batch
