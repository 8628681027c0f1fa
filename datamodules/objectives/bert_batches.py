"""BERT's batches (`BertBatches`): next-sentence instances, regenerated every epoch, collated
with fresh masked-LM masks (`masking`), and what a split needs to make them.

Items (`datamodules.objectives.batches` for how batches are keyed), T = longest instance rounded
up to a multiple of 8 (at most seq_len):
    input_ids        (B, T)  [CLS] A [SEP] B [SEP] then [PAD], after MLM replacement
    token_type_ids   (B, T)  0 for [CLS] A [SEP], 1 for B [SEP], 0 for padding
    attention_mask   (B, T)  1 for real tokens, 0 for padding
    masked_positions (N,)    flat indices row * T + col of the N predicted tokens, ascending
                             (what `BertForPreTraining.forward(masked_positions=...)` gathers)
    mlm_labels       (N,)    original ids at those positions
    nsp_labels       (B,)    0 = B follows A, 1 = B is random (only with NSP)
"""

from __future__ import annotations

import numpy as np

from datamodules.corpora.corpus import DataSetupError
from datamodules.objectives.batches import (
    INSTANCES,
    SPLIT_NAMES,
    EpochBatches,
    LossCount,
    as_int64,
)
from datamodules.objectives.masking import MLMMasker
from datamodules.objectives.nsp import LABEL, NO_PAIR, InstanceBuilder
from datamodules.objectives.splits import Shortage
from datamodules.stores.store import TokenStore
from tokenizer import SpecialIds

_PAD_MULTIPLE = 8


class BertBatches(EpochBatches):
    """NSP instances, regenerated every epoch, collated with fresh MLM masks.

    An epoch's instances depend on its seed, so their number varies a little between epochs;
    the epoch size is fixed to epoch 0's count (Lightning and the LR schedule need a fixed
    length): a larger epoch leaves out its last few shuffled instances, a smaller one repeats
    its first few.

    Args:
        store: a BERT store (with sentences).
        documents: the split's document indices.
        objective: the MLM/NSP settings (a `MaskedLMObjective`).
        masker: the MLM masker.
        special: the tokenizer's special ids.
        **shard: the keyword arguments of `EpochBatches`.
    """

    def __init__(
        self,
        store: TokenStore,
        documents: np.ndarray,
        objective,
        masker: MLMMasker,
        special: SpecialIds,
        **shard,
    ) -> None:
        if store.sentence_offsets is None:
            raise ValueError(f"{store.path} has no sentence offsets: it is not a BERT store")
        super().__init__(objective.batch_size, **shard)
        if objective.next_sentence_prediction:
            require_pairs(self.split, np.diff(store.doc_sentences)[documents])
        self.store = store
        self.objective = objective
        self.masker = masker
        self.special = special
        self.builder = InstanceBuilder(
            store.sentence_offsets,
            store.doc_sentences,
            documents,
            objective.seq_len,
            objective.short_seq_prob,
            objective.next_sentence_prediction,
        )
        self._instances: dict[int, np.ndarray] = {}
        self.set_num_items(len(self.instances(0)))

    def instances(self, epoch: int) -> np.ndarray:
        """(M, 6) the epoch's NSP instances (see `datamodules.objectives.nsp.FIELDS`), cached for this and
        the previous epoch (a mixture's batch may straddle a source's epochs)."""
        if epoch not in self._instances:
            seed = self.rng(epoch, INSTANCES).integers(1 << 63)
            self._instances = {e: t for e, t in self._instances.items() if e == epoch - 1}
            self._instances[epoch] = self.builder.build(int(seed))
        return self._instances[epoch]

    def item_tokens(self) -> float:
        table = self.instances(0)
        a_len, b_len = table[:, 1] - table[:, 0], table[:, 4] - table[:, 3]
        return float(np.mean(2 + a_len + np.where(table[:, LABEL] != NO_PAIR, b_len + 1, 0)))

    def _make_order(self, epoch: int) -> np.ndarray:
        order = self._arrange(epoch, len(self.instances(epoch)))
        return np.resize(order, self.plan.num_items)  # cut, or wrap around to the start

    def make_batch(
        self, epoch: int, items: np.ndarray, rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        table = self.instances(epoch)[items]
        input_ids, token_type_ids, attention_mask = assemble_pairs(
            self.store.tokens, table, self.special, self.objective.seq_len
        )
        masked, positions, labels = self.masker(input_ids, rng)
        batch = {
            "input_ids": masked,
            "token_type_ids": token_type_ids,
            "attention_mask": attention_mask,
            "masked_positions": positions,
            "mlm_labels": labels,
        }
        if self.objective.next_sentence_prediction:
            batch["nsp_labels"] = table[:, LABEL]
        return as_int64(batch)

    def loss_counts(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        counts = {LossCount.MASKED: len(batch["mlm_labels"])}
        if "nsp_labels" in batch:
            counts[LossCount.SEQUENCES] = len(batch["nsp_labels"])
        return counts


def assemble_pairs(
    tokens: np.ndarray, table: np.ndarray, special: SpecialIds, seq_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay out instances as `[CLS] A [SEP] B [SEP]` rows, padded to the longest.

    Args:
        tokens: (N,) the store's token array.
        table: (B, 6) instances (`datamodules.objectives.nsp.FIELDS`).
        special: special ids (cls, sep, pad).
        seq_len: the objective's length; rows are padded to the longest rounded up to a
            multiple of 8 (tensor-core friendly) but never beyond seq_len.

    Returns:
        input_ids, token_type_ids, attention_mask, each (B, T) int64.
    """
    a_start, a_end, _, b_start, b_end, label = table.T
    has_b = label != NO_PAIR
    a_len, b_len = a_end - a_start, b_end - b_start
    lengths = 2 + a_len + np.where(has_b, b_len + 1, 0)
    longest = int(lengths.max())
    width = min(-(-longest // _PAD_MULTIPLE) * _PAD_MULTIPLE, max(seq_len, longest))
    input_ids = np.full((len(table), width), special.pad, dtype=np.int64)
    token_type_ids = np.zeros((len(table), width), dtype=np.int64)
    input_ids[:, 0] = special.cls
    for row in range(len(table)):
        a = int(a_len[row])
        input_ids[row, 1 : 1 + a] = tokens[a_start[row] : a_end[row]]
        input_ids[row, 1 + a] = special.sep
        if has_b[row]:
            b = int(b_len[row])
            input_ids[row, 2 + a : 2 + a + b] = tokens[b_start[row] : b_end[row]]
            input_ids[row, 2 + a + b] = special.sep
            token_type_ids[row, 2 + a : 3 + a + b] = 1
    attention_mask = (np.arange(width) < lengths[:, None]).astype(np.int64)
    return input_ids, token_type_ids, attention_mask


def require_pairs(split: int, sentences: np.ndarray) -> None:
    """Raise `DataSetupError` unless a split's documents, of `sentences` (M,) sentences each,
    make next-sentence pairs: half of the pairs take their second sentence from another
    document, and a pair starts at a sentence that has a next one (`datamodules.objectives.nsp`)."""
    alone = "or train the masked LM alone: objective.next_sentence_prediction=false"
    if len(sentences) < 2:
        raise DataSetupError(
            f"the {SPLIT_NAMES[split]} split has {len(sentences)} document(s), and BERT's "
            "next-sentence prediction needs at least 2 (half of its pairs take the second "
            f"sentence from another document); add documents, {alone}"
        )
    if sentences.max() < 2:
        raise DataSetupError(
            f"the {len(sentences)} {SPLIT_NAMES[split]} documents hold one sentence each, and "
            "BERT's next-sentence prediction needs documents of 2 sentences or more (a pair "
            "starts at a sentence that has a next one; a sentence ends at a line end, or at "
            f". ! ? before a capital letter or digit); add text, {alone}"
        )


def too_few_for_pairs(short: Shortage) -> str:
    """What to say when a corpus is too few for next-sentence pairs in every split (half of
    the pairs take their second sentence from another document of the split)."""
    documents, min_train, val_fraction = (
        short.err.documents,
        short.err.min_train,
        short.val_fraction,
    )
    need = (
        "BERT's next-sentence prediction needs at least 2 documents per split (half of "
        "its pairs take the second sentence from another document)"
    )
    if val_fraction > 0:
        need += f": 2 for training and 2 for validation ({short.held_out})"
    if documents >= min_train:
        fix = "train without validation: datamodule.val_fraction=0"
    else:  # the masked LM alone trains on one document (and validates on another)
        fix = "train the masked LM alone: objective.next_sentence_prediction=false" + (
            " datamodule.val_fraction=0" if val_fraction > 0 else ""
        )
    least = min_train + (2 if val_fraction > 0 else 0)
    return f"{short.have}: {need}. Add documents ({least} or more in all), or {fix}"
