"""Fixtures of the data-pipeline tests: small tokenizers trained on the fly, real corpora (the
embedded corpus, WikiText-2 from the shared data folder) and their token stores, built once per
session in a temporary cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from datamodules.corpora.corpus import EmbeddedCorpus, TextFilesCorpus
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.stores.store import TokenStore
from tests.datamodules.helpers import WIKITEXT_TRAIN, build
from tokenizer import batched, train_tokenizer


@pytest.fixture(scope="session")
def embedded() -> EmbeddedCorpus:
    return EmbeddedCorpus()


@pytest.fixture(scope="session")
def wordpiece(embedded):
    return train_tokenizer("wordpiece", batched(embedded.documents()), 3000)


@pytest.fixture(scope="session")
def bpe(embedded):
    return train_tokenizer("bpe", batched(embedded.documents()), 1000)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def wikitext() -> TextFilesCorpus:
    """WikiText-2 train (tokenized, 600 articles, 10.8 MB) through the local-files source."""
    if not WIKITEXT_TRAIN.is_file():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT_TRAIN} (set LMPIPE_SHARED_DATA)")
    return TextFilesCorpus(str(WIKITEXT_TRAIN), doc_split="wikitext")


@pytest.fixture(scope="session")
def bert_store(embedded, wordpiece, cache_dir) -> TokenStore:
    return build(embedded, wordpiece, MaskedLMObjective(), cache_dir)


@pytest.fixture(scope="session")
def gpt_store(embedded, bpe, cache_dir) -> TokenStore:
    return build(embedded, bpe, CausalLMObjective(), cache_dir)


@pytest.fixture(scope="session")
def wiki_bert_store(wikitext, wordpiece, cache_dir) -> TokenStore:
    return build(wikitext, wordpiece, MaskedLMObjective(), cache_dir)


@pytest.fixture(scope="session")
def wiki_gpt_store(wikitext, bpe, cache_dir) -> TokenStore:
    return build(wikitext, bpe, CausalLMObjective(), cache_dir)
