"""GPT's batches (`GPTBatches`): fixed windows of a split's documents packed into one token
stream (`packing`), and what a split needs to make them.

Items (`datamodules.objectives.batches` for how batches are keyed), T = objective.seq_len:
    input_ids        (B, T)  packed stream tokens
    targets          (B, T)  the same window shifted by one (`GPT.forward(targets=...)`)
    doc_ids          (B, T)  segment ids, only with document_masking (see `packing`)
    position_ids     (B, T)  positions restarting per segment, only with document_masking
    target_bytes     (1,)    UTF-8 bytes of text the targets stand for, only when the dataset
                             has the tokenizer's byte counts (validation, for bits per byte)
"""

from __future__ import annotations

import numpy as np

from datamodules.corpora.corpus import DataSetupError
from datamodules.objectives.batches import SPLIT_NAMES, TRAIN, EpochBatches, LossCount, as_int64
from datamodules.objectives.packing import PackedStream, document_ids
from datamodules.objectives.splits import Shortage
from datamodules.stores.store import TokenStore


def too_little_for_a_window(short: Shortage, seq_len: int) -> str | None:
    """What to say when a corpus holds less than one training window of `seq_len` inputs and
    one more target: one window of all the text, without validation, is what it allows; None
    when it holds a window."""
    window = seq_len + 1
    if short.tokens >= window:
        return None
    without = " datamodule.val_fraction=0" if short.val_fraction > 0 else ""
    return (
        f"{short.have}: too little text for one training window of objective.seq_len + 1 = "
        f"{window} tokens. Add text, or train on one shorter window"
        f"{' without validation' if without else ''}: objective.seq_len={short.tokens - 1}"
        f"{without}"
    )


def require_window(split: int, tokens: int, seq_len: int) -> None:
    """Raise `DataSetupError` unless a split's stream of `tokens` tokens holds one GPT window
    (`seq_len` inputs and one more target: `PackedStream.num_windows`)."""
    if tokens < seq_len + 1:
        fix = "a larger datamodule.val_fraction, or a shorter objective.seq_len"
        if split == TRAIN:
            fix = "more text"
            if tokens > 1:
                fix += f", or shorter windows: objective.seq_len={tokens - 1}"
        raise DataSetupError(
            f"the {SPLIT_NAMES[split]} documents hold {tokens} tokens, fewer than one window of "
            f"objective.seq_len + 1 = {seq_len + 1}; use {fix}"
        )


class GPTBatches(EpochBatches):
    """Packed windows of a split's document stream.

    Args:
        store: a GPT store (documents end with EOS).
        documents: the split's document indices.
        objective: the causal-LM settings (a `CausalLMObjective`).
        token_bytes: (vocab,) bytes of text per token id (`tokenizer.token_bytes`): batches
            then carry `target_bytes`.
        **shard: the keyword arguments of `EpochBatches`.
    """

    def __init__(
        self,
        store: TokenStore,
        documents: np.ndarray,
        objective,
        token_bytes: np.ndarray | None = None,
        **shard,
    ) -> None:
        if store.eos_id is None:
            raise ValueError(f"{store.path} has no end-of-text separators: it is not a GPT store")
        super().__init__(objective.batch_size, **shard)
        self.stream = PackedStream(store.tokens, store.doc_offsets, documents)
        self.objective = objective
        self.eos_id = store.eos_id
        self.token_bytes = token_bytes
        require_window(self.split, len(self.stream), objective.seq_len)
        self.set_num_items(self.stream.num_windows(objective.seq_len))

    def make_batch(
        self, epoch: int, items: np.ndarray, rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        windows = self.stream.windows(items, self.objective.seq_len)
        batch = {"input_ids": windows[:, :-1], "targets": windows[:, 1:]}
        if self.objective.document_masking:
            batch["doc_ids"], batch["position_ids"] = document_ids(batch["input_ids"], self.eos_id)
        if self.token_bytes is not None:
            batch["target_bytes"] = self.token_bytes[batch["targets"]].sum()
        return as_int64(batch)

    def loss_counts(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        return {LossCount.TARGETS: int(batch["targets"].size)}

    def item_tokens(self) -> float:
        return float(self.objective.seq_len)
