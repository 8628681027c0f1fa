"""Tokenizers: train WordPiece (BERT) and byte-level BPE (GPT), load existing ones, cache them."""

from tokenizer.build import EmptyCorpusError, batched, train_tokenizer
from tokenizer.cache import atomic_path, tokenizers_version, write_text_atomic
from tokenizer.load import TokenizerLoadError, load_tokenizer
from tokenizer.spec import (
    TokenizerSpec,
    get_tokenizer,
    tokenizer_cache_path,
    warn_if_short_vocabulary,
)
from tokenizer.special import (
    BPE_TEMPLATE,
    TEMPLATE_BY_KIND,
    WORDPIECE_TEMPLATE,
    InputTemplate,
    MissingSpecialTokensError,
    SpecialIds,
    UnsupportedTokenizerError,
    special_ids,
    tokenizer_kind,
)

__all__ = [
    "BPE_TEMPLATE",
    "TEMPLATE_BY_KIND",
    "WORDPIECE_TEMPLATE",
    "EmptyCorpusError",
    "InputTemplate",
    "MissingSpecialTokensError",
    "SpecialIds",
    "TokenizerLoadError",
    "TokenizerSpec",
    "UnsupportedTokenizerError",
    "atomic_path",
    "batched",
    "get_tokenizer",
    "load_tokenizer",
    "special_ids",
    "tokenizer_cache_path",
    "tokenizer_kind",
    "tokenizers_version",
    "train_tokenizer",
    "warn_if_short_vocabulary",
    "write_text_atomic",
]
