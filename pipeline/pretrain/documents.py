"""The training documents of a pretraining run, read back from the config its checkpoints
record: the same corpus, tokenizer, store and validation split as the run trained on, for what
is counted from the very text the model saw (the n-gram row of `make evaluate-lm suite=blimp`),
and the key that identifies them, for what is cached from them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from tokenizers import Tokenizer

from datamodules.objectives.splits import TRAINING_DOCUMENTS_FORMAT
from datamodules.pretrain import PretrainDataModule
from datamodules.stores.store import STORE_FORMAT, tokenizer_hash
from pipeline.pretrain.checks import check_config
from pipeline.pretrain.run import build_datamodule
from pipeline.run.errors import ConfigError
from tokenizer.cache import tokenizers_version


@dataclass(frozen=True)
class TrainingText:
    """A run's training documents, as its datamodule reads them (`documents`), and `key`.

    Attributes:
        datamodule: the run's datamodule, rebuilt from its config (nothing read yet).
        key: identifies the documents: the corpus's fingerprint (its files' content, or their
            size and time past 1 GiB: `datamodules.corpora.fingerprint`), the settings that
            split and tokenize them (`datamodule`, `objective`, `seed`), the tokenizer, the
            `tokenizers` version and the token store's format, as the token store's own key
            has them, and the version of how documents are held out for validation
            (`TRAINING_DOCUMENTS_FORMAT`). A setting that cannot change the documents (a batch
            size) changes the key too: a cache keyed by it may count again where it need not.
    """

    datamodule: PretrainDataModule
    key: str

    def documents(self) -> Iterator[np.ndarray]:
        """The token ids of each training document; the token store is reused from the cache
        (built when it is not there), and the validation documents are held out as a
        one-process run holds them out."""
        return self.datamodule.training_documents()


def run_training_text(config: dict[str, Any], tokenizer: Tokenizer) -> TrainingText:
    """The training text of the run whose resolved config is `config` (a checkpoint's
    `CheckpointRecord.config`), tokenized by its `tokenizer`.

    Raises:
        ConfigError: no config recorded (an HF export, a foreign checkpoint), or a corpus that
            is no longer where the run read it.
    """
    if not config or "data" not in config:
        raise ConfigError(
            "the checkpoint records no pretraining config, so its corpus is unknown; give the "
            "run's folder or one of its checkpoints/*.ckpt"
        )
    cfg = OmegaConf.create(config)
    plan = check_config(cfg)
    datamodule = build_datamodule(cfg, plan, tokenizer)
    settings = {name: config.get(name) for name in ("datamodule", "objective", "seed")}
    parts = [
        datamodule.corpus.fingerprint(),
        settings,
        tokenizer_hash(tokenizer),
        tokenizers_version(),
        STORE_FORMAT,
        TRAINING_DOCUMENTS_FORMAT,
    ]
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    return TrainingText(datamodule, digest.hexdigest()[:16])
