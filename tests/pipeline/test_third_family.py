"""A third family is a model, an objective, a LightningModule and one `register(...)`: the toy
family below (a one-layer recurrent LM that predicts the next token within each document, never
across two) pretrains through the real pretraining path with no change to any library module.
Its objective subclasses the base `Objective` only, so every place of the data path that it
reaches asks the objective, not which family it is."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn import functional as F

from datamodules.corpora.corpus import DataSetupError
from datamodules.objectives.batches import SPLIT_NAMES, EpochBatches, LossCount, as_int64
from datamodules.objectives.objective import Objective, check_phases
from datamodules.stores.store import StoreSettings
from pipeline.checkpoint.load import load_pretrained
from pipeline.pretrain.checks import check_config
from pipeline.pretrain.modules import PretrainModule
from pipeline.pretrain.run import train
from pipeline.run.families import Family, register, unregister
from pipeline.run.folder import LOG_DIR
from tests.conftest import compose_pretrain
from tokenizer import tokenizer_kind


@dataclass
class ChunkConfig:
    """The toy model's architecture."""

    vocab_size: int = 256
    d_model: int = 32
    max_seq_len: int = 32


class ChunkLM(nn.Module):
    """Embeddings, one GRU layer (causal by construction) and an output layer.

    Shapes: B batch, T tokens, D width, V vocabulary."""

    def __init__(self, config: ChunkConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.rnn = nn.GRU(config.d_model, config.d_model, batch_first=True)
        self.out = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        states_BTD, _ = self.rnn(self.embed(input_ids))
        return self.out(states_BTD)  # (B, T, V)


class ChunkBatches(EpochBatches):
    """Each document cut into chunks of `seq_len` + 1 tokens (its remainder left out): unlike
    GPT's packed windows, no item crosses from one document into the next."""

    def __init__(self, store, documents: np.ndarray, objective: ChunkObjective, **shard) -> None:
        super().__init__(objective.batch_size, **shard)
        objective.check_split(self.split, store, documents)
        self.tokens, self.seq_len = store.tokens, objective.seq_len
        offsets = store.doc_offsets
        self.starts = np.array(
            [
                start
                for d in documents
                for start in range(offsets[d], offsets[d + 1] - self.seq_len, self.seq_len + 1)
            ],
            dtype=np.int64,
        )
        self.set_num_items(len(self.starts))

    def make_batch(self, epoch: int, items: np.ndarray, rng: np.random.Generator):
        rows = self.tokens[self.starts[items, None] + np.arange(self.seq_len + 1)]
        return as_int64({"input_ids": rows[:, :-1], "targets": rows[:, 1:]})

    def loss_counts(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        return {LossCount.TARGETS: int(batch["targets"].size)}

    def item_tokens(self) -> float:
        return float(self.seq_len)


@dataclass
class ChunkObjective(Objective):
    """Next-token prediction within each document, in chunks (`ChunkBatches`)."""

    seq_len: int = 32
    batch_size: int = 4
    phases: list[dict[str, Any]] | None = None

    many_passes = 10.0

    def __post_init__(self) -> None:
        self.phases = check_phases(self)

    def store_settings(self, tokenizer) -> StoreSettings:
        return StoreSettings(sentences=False)  # documents apart: no separator between them

    def make_batches(self, store, documents, maker, **shard) -> EpochBatches:
        return ChunkBatches(store, documents, self, **shard)

    def validation_tokens(self, world_size: int) -> int:
        return world_size * (self.seq_len + 1)  # a chunk for every process, if one document

    def check_split(self, split: int, store, documents: np.ndarray) -> None:
        longest = int(np.diff(store.doc_offsets)[documents].max(initial=0))
        if longest <= self.seq_len:
            raise DataSetupError(
                f"no {SPLIT_NAMES[split]} document holds a chunk of objective.seq_len + 1 = "
                f"{self.seq_len + 1} tokens (the longest has {longest}); use longer documents, "
                f"or objective.seq_len={max(1, longest - 1)}"
            )


class ChunkPretraining(PretrainModule):
    loss_terms = {"loss": LossCount.TARGETS}  # noqa: RUF012 (as the pipeline's modules declare it)

    def build_model(self, config: ChunkConfig) -> ChunkLM:
        return ChunkLM(config)

    def metric_names(self) -> list[str]:
        return ["loss"]

    @property
    def flops_per_token(self) -> float:
        return 6.0 * self.parameter_count()

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
        logits_BTV = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits_BTV.flatten(0, 1), batch["targets"].flatten())
        return {"loss": (loss, batch["targets"].numel())}


CHUNK = Family(
    name="chunk",
    config_class=ChunkConfig,
    model_class=ChunkLM,
    backbone_class=ChunkLM,
    block_class=nn.GRU,
    tokenizer_kind="bpe",
    objective_class=ChunkObjective,
    module_class=ChunkPretraining,
    vocab_multiple=8,
    try_command=("evaluate-lm", "text=Once upon a time"),
    hf_auto_class=None,  # no HF mapping: a run exports no hf/ folder
)


@pytest.fixture
def chunk_family():
    register(CHUNK)
    yield CHUNK
    unregister(CHUNK.name)


def chunk_run(tmp_path, *overrides: str):
    """A pretraining config of the toy family: GPT's tokenizer and recipe (a family with no
    recipe of its own may train with any), its own model and objective nodes."""
    cfg = compose_pretrain(
        "model=gpt-tiny",
        "tokenizer.vocab_size=400",
        "recipe=gpt-reference",  # AdamW, warmup then cosine
        "optim.lr=5e-2",
        "schedule.warmup_ratio=0",
        "logger=csv",
        "trainer.max_steps=12",
        "trainer.val_check_interval=12",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        f"paths.cache_dir={tmp_path / 'cache'}",
        *overrides,
    )
    cfg.model = OmegaConf.create({"_target_": f"{__name__}.ChunkConfig", "d_model": 32})
    cfg.objective = OmegaConf.create({"_target_": f"{__name__}.ChunkObjective"})
    cfg.paths.output_dir = str(tmp_path / "run")
    return cfg


def test_a_third_family_pretrains_through_the_real_path(chunk_family, tmp_path):
    cfg = chunk_run(tmp_path)
    plan = check_config(cfg)
    assert plan.family == "chunk" and isinstance(plan.objective, ChunkObjective)
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # Hydra makes it for the command
    train(cfg, plan)

    with open(run_dir / LOG_DIR / "metrics.csv") as f:
        losses = [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert len(losses) == 12 and all(math.isfinite(loss) for loss in losses)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5  # it learns: 12 steps at 5e-2
    loaded = load_pretrained(run_dir)  # its checkpoints/last.ckpt, through the registry
    assert loaded.family == "chunk" and tokenizer_kind(loaded.tokenizer) == "bpe"
    assert isinstance(loaded.model, ChunkLM) and loaded.model.config.vocab_size % 8 == 0
    assert loaded.trained_seq_len == 32
    assert not (run_dir / "hf").exists()  # the family has no HF mapping


def test_a_third_family_s_objective_says_what_its_splits_need(chunk_family, tmp_path):
    """The check before a run writes anything is the objective's: a corpus whose documents
    are shorter than a chunk fails with its message and fix."""
    short = ("data=text_files", f"data.paths={tmp_path / 'short.txt'}", "datamodule.val_fraction=0")
    cfg = chunk_run(tmp_path, *short)
    (tmp_path / "short.txt").write_text("A few words.\n\nAnd a few more.\n" * 3)
    cfg.objective.seq_len = 24
    with pytest.raises(DataSetupError, match=r"no training document holds a chunk of .* 25 "):
        train(cfg, check_config(cfg))
    assert not (tmp_path / "run" / "checkpoints").exists()
