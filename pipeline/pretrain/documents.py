"""The training documents of a pretraining run, read back from the config its checkpoints
record: the same corpus, tokenizer, store and validation split as the run trained on, for what
is counted from the very text the model saw (the n-gram row of `make evaluate-lm suite=blimp`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from tokenizers import Tokenizer

from pipeline.pretrain.checks import check_config
from pipeline.pretrain.run import build_datamodule
from pipeline.run.errors import ConfigError


def run_training_documents(config: dict[str, Any], tokenizer: Tokenizer) -> Iterator[np.ndarray]:
    """The token ids of each training document of the run whose resolved config is `config`
    (a checkpoint's `CheckpointRecord.config`), tokenized by its `tokenizer`; the token store is
    reused from the cache (built when it is not there). The validation documents are held out
    as a one-process run holds them out.

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
    return build_datamodule(cfg, plan, tokenizer).training_documents()
