"""Helpers shared by the data-pipeline tests."""

from __future__ import annotations

import numpy as np

from datamodules.run_stores import store_settings
from datamodules.stores.build import open_or_build_store
from datamodules.stores.store import TokenStore
from tests.conftest import SHARED_DATA

WIKITEXT_TRAIN = SHARED_DATA / "wikitext/wikitext-2-tokenized/train.txt.gz"


def build(corpus, tokenizer, objective, cache_dir) -> TokenStore:
    """The store of (corpus, tokenizer, objective) in cache_dir, built if missing."""
    settings = store_settings(objective, tokenizer)
    return open_or_build_store(corpus, tokenizer, settings, cache_dir)[0]


def all_documents(store: TokenStore) -> np.ndarray:
    return np.arange(store.num_documents)
