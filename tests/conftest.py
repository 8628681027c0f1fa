"""Shared fixtures: composing the real Hydra configs, small corpora, the shared data folder."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from pipeline.cli import register_resolvers

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
SHARED_DATA = Path(os.environ.get("LMPIPE_SHARED_DATA", REPO.parent / "shared" / "data"))


def compose_pretrain(*overrides: str, hydra_node: bool = False) -> DictConfig:
    """Compose conf/pretrain.yaml with overrides, as `make pretrain` would (no run started)."""
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("pretrain", overrides=list(overrides), return_hydra_config=hydra_node)
    if not hydra_node:
        OmegaConf.set_struct(cfg, False)
        cfg.paths.output_dir = "unused-output-dir"
    return cfg


class ListCorpus:
    """An in-memory corpus with the same interface as datamodules.corpus."""

    def __init__(self, docs: list[str]) -> None:
        self.docs = docs
        self.reads = 0

    def documents(self):
        self.reads += 1
        yield from self.docs

    def fingerprint(self) -> str:
        return hashlib.sha256("\0".join(self.docs).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return f"{len(self.docs)} in-memory documents"


@pytest.fixture(scope="session")
def small_docs() -> list[str]:
    """~150 KB of real English prose from the embedded corpus (first 30 documents)."""
    from datamodules.corpus import EmbeddedCorpus

    docs = list(EmbeddedCorpus().documents())
    return docs[:30]


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared datasets not found at {SHARED_DATA} (set LMPIPE_SHARED_DATA)")
    return SHARED_DATA
