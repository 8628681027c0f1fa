"""Datasets whose items are whole, collated batches, keyed by (epoch, batch index).

A batch is a pure function of (seed, split, epoch, batch index, rank): which items it holds
(`ShardPlan` over the epoch's seeded order) and its random masks (a generator seeded by the same
numbers). DataLoader workers therefore build exactly the batches the main process would, in any
number, and a resumed run rebuilds batch k of epoch e directly instead of replaying 0..k-1.

Items are dicts of int64 numpy arrays (`PretrainDataModule`'s loaders hand them out as torch
tensors; see `datamodules.pretrain.BatchLoader` for why the conversion happens there):

BERT (`BertBatches`), T = longest instance rounded up to a multiple of 8 (at most seq_len):
    input_ids        (B, T)  [CLS] A [SEP] B [SEP] then [PAD], after MLM replacement
    token_type_ids   (B, T)  0 for [CLS] A [SEP], 1 for B [SEP], 0 for padding
    attention_mask   (B, T)  1 for real tokens, 0 for padding
    masked_positions (N,)    flat indices row * T + col of the N predicted tokens, ascending
                             (what `BertForPreTraining.forward(masked_positions=...)` gathers)
    mlm_labels       (N,)    original ids at those positions
    nsp_labels       (B,)    0 = B follows A, 1 = B is random (only with NSP)

GPT (`GPTBatches`), T = objective.seq_len:
    input_ids        (B, T)  packed stream tokens
    targets          (B, T)  the same window shifted by one (`GPT.forward(targets=...)`)
    doc_ids          (B, T)  segment ids, only with document_masking (see `packing`)
    position_ids     (B, T)  positions restarting per segment, only with document_masking
    target_bytes     (1,)    UTF-8 bytes of text the targets stand for, only when the dataset
                             has the tokenizer's byte counts (validation, for bits per byte)
"""

from __future__ import annotations

import functools

import numpy as np
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from datamodules.corpora.corpus import DataSetupError
from datamodules.objectives.masking import MLMMasker, continuation_table
from datamodules.objectives.nsp import LABEL, NO_PAIR, InstanceBuilder
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.objectives.packing import PackedStream, document_ids
from datamodules.objectives.sharding import ShardPlan, TooFewDocuments
from datamodules.stores.store import TokenStore
from tokenizer import SpecialIds, special_ids
from tokenizer.token_bytes import token_byte_counts

TRAIN, VAL = 0, 1  # split tags mixed into every seed, so the two never share randomness
SPLIT_NAMES = ("training", "validation")
_ORDER, _INSTANCES, _BATCH = 1, 2, 3  # purpose tags, likewise
_PAD_MULTIPLE = 8


class EpochBatches(Dataset):
    """Base class: one rank's batches of an epoch. Subclasses say what the items are (calling
    `set_num_items` once they know how many) and how a batch of them is built.

    Args:
        batch_size: items per batch on each rank.
        rank, world_size: this process's shard.
        seed: the run's data seed (>= 0).
        split: TRAIN or VAL.
        shuffle: a new seeded item order every epoch; False keeps the natural order.
    """

    def __init__(
        self, batch_size: int, *, rank: int, world_size: int, seed: int, split: int, shuffle: bool
    ) -> None:
        if seed < 0:
            raise ValueError(f"the data seed must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.split = split
        self.shuffle = shuffle
        self.plan = ShardPlan(0, batch_size, world_size)
        self._orders: dict[int, np.ndarray] = {}

    def set_num_items(self, num_items: int) -> None:
        """Fix the number of items per epoch (the same every epoch)."""
        self.plan = ShardPlan(num_items, self.batch_size, self.world_size)
        self._orders = {}

    def __len__(self) -> int:
        return self.plan.num_batches

    def __getitem__(self, key: tuple[int, int]) -> dict[str, np.ndarray]:
        epoch, index = key
        rng = np.random.default_rng([self.seed, self.split, _BATCH, epoch, index, self.rank])
        return self.make_batch(epoch, self.batch_items(epoch, index), rng)

    def batch_items(self, epoch: int, index: int) -> np.ndarray:
        """Item ids (into the epoch's items) of this rank's batch `index`."""
        start, stop = self.plan.bounds(index, self.rank)
        return self.order(epoch)[start:stop]

    def order(self, epoch: int) -> np.ndarray:
        """(num_items,) the epoch's item order (cached for the current and previous epoch)."""
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = self._make_order(epoch)
        return self._orders[epoch]

    def _make_order(self, epoch: int) -> np.ndarray:
        return self._arrange(epoch, self.plan.num_items)

    def _arrange(self, epoch: int, count: int) -> np.ndarray:
        """0..count-1, shuffled by the epoch's seed when the dataset shuffles."""
        if not self.shuffle:
            return np.arange(count)
        return self.rng(epoch, _ORDER).permutation(count)

    def rng(self, epoch: int, purpose: int) -> np.random.Generator:
        """A generator for one purpose in one epoch, the same on every rank."""
        return np.random.default_rng([self.seed, self.split, purpose, epoch])

    def make_batch(
        self, epoch: int, items: np.ndarray, rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def loss_counts(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        """How many predictions each loss term of the objective averages over in `batch`."""
        raise NotImplementedError

    def item_tokens(self) -> float:
        """Tokens per item (GPT: the window; BERT: the mean of epoch 0's instances)."""
        raise NotImplementedError


def merge_batches(parts: list[dict[str, np.ndarray]], pad_id: int) -> dict[str, np.ndarray]:
    """One batch of the rows of `parts` (batches of one layout), in order: (B, T) arrays padded
    to the widest (`input_ids` with `pad_id`, the rest with 0), flat `masked_positions`
    re-indexed to the merged width, per-row and per-prediction arrays concatenated, 0-d totals
    summed."""
    if len(parts) == 1:
        return parts[0]
    width = max(p["input_ids"].shape[1] for p in parts)
    merged: dict[str, np.ndarray] = {}
    for name in parts[0]:
        arrays = [p[name] for p in parts]
        if name == "masked_positions":
            rows = np.cumsum([0] + [p["input_ids"].shape[0] for p in parts])
            arrays = [
                (first + pos // p["input_ids"].shape[1]) * width + pos % p["input_ids"].shape[1]
                for first, pos, p in zip(rows, arrays, parts, strict=False)
            ]
        elif arrays[0].ndim == 2:
            fill = pad_id if name == "input_ids" else 0
            arrays = [
                np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill) for a in arrays
            ]
        elif arrays[0].ndim == 0:
            merged[name] = np.sum(arrays, dtype=arrays[0].dtype)
            continue
        merged[name] = np.concatenate(arrays)
    return merged


STEP_TOTAL = "step_total_"  # key prefix of a step's totals in its micro-batches


class LossCount:
    """Names of what a loss term averages over (`EpochBatches.loss_counts`, whose totals a step
    carries as `step_total_<name>`; the LightningModules' `loss_terms` refer to them)."""

    MASKED = "masked"  # masked tokens (MLM)
    SEQUENCES = "sequences"  # sequences (NSP)
    TARGETS = "targets"  # next-token targets (causal LM)


class StepBatches(Dataset):
    """The micro-batches of whole optimizer steps, for gradient accumulation.

    Step s of an epoch is batches s*k .. s*k+k-1 of `batches` (so the micro-batches are the
    ones a run without accumulation sees, in the same order). Each carries the step's total of
    every loss count (`step_total_<name>`, a 0-d array), so the loss can be normalized by the
    number of predictions in the whole step rather than averaged over micro-batch means. An
    epoch's last batches that do not fill a step are left out.

    Args:
        batches: one rank's batches of an epoch.
        micro_batches: batches per optimizer step (k >= 1).
    """

    def __init__(self, batches: EpochBatches, micro_batches: int) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if len(batches) < micro_batches:
            raise DataSetupError(
                f"an epoch has {len(batches)} batches per process, fewer than the "
                f"{micro_batches} micro-batches of one optimizer step; lower "
                "trainer.accumulate_grad_batches or objective.batch_size, or use more text"
            )
        self.batches = batches
        self.micro_batches = micro_batches

    def __len__(self) -> int:
        return len(self.batches) // self.micro_batches

    def __getitem__(self, key: tuple[int, int]) -> list[dict[str, np.ndarray]]:
        epoch, step = key
        first = step * self.micro_batches
        group = [self.batches[(epoch, first + i)] for i in range(self.micro_batches)]
        totals: dict[str, int] = {}
        for batch in group:
            for name, count in self.batches.loss_counts(batch).items():
                totals[name] = totals.get(name, 0) + count
        extra = {STEP_TOTAL + name: np.array(total, np.int64) for name, total in totals.items()}
        return [batch | extra for batch in group]


def _int64(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(v, np.int64) for name, v in batch.items()}


class BertBatches(EpochBatches):
    """NSP instances, regenerated every epoch, collated with fresh MLM masks.

    An epoch's instances depend on its seed, so their number varies a little between epochs;
    the epoch size is fixed to epoch 0's count (Lightning and the LR schedule need a fixed
    length): a larger epoch leaves out its last few shuffled instances, a smaller one repeats
    its first few.

    Args:
        store: a BERT store (with sentences).
        documents: the split's document indices.
        objective: the MLM/NSP settings.
        masker: the MLM masker.
        special: the tokenizer's special ids.
        **shard: the keyword arguments of `EpochBatches`.
    """

    def __init__(
        self,
        store: TokenStore,
        documents: np.ndarray,
        objective: MaskedLMObjective,
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
            seed = self.rng(epoch, _INSTANCES).integers(1 << 63)
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
        return _int64(batch)

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
        objective: the causal-LM settings.
        token_bytes: (vocab,) bytes of text per token id (`tokenizer.token_bytes`): batches
            then carry `target_bytes`.
        **shard: the keyword arguments of `EpochBatches`.
    """

    def __init__(
        self,
        store: TokenStore,
        documents: np.ndarray,
        objective: CausalLMObjective,
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
        return _int64(batch)

    def loss_counts(self, batch: dict[str, np.ndarray]) -> dict[str, int]:
        return {LossCount.TARGETS: int(batch["targets"].size)}

    def item_tokens(self) -> float:
        return float(self.objective.seq_len)


class BatchMaker:
    """Makes a split's batches of a store for an objective: GPT windows, or BERT NSP instances
    with MLM masks. Picklable (streaming's loader workers make their blocks' batches with it).

    Args:
        tokenizer: the run's tokenizer (special ids, vocabulary size, word continuations for
            whole-word masking, bytes per token for bits per byte).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special = special_ids(tokenizer)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def _continuation(self) -> np.ndarray:
        return continuation_table(self.tokenizer)

    @functools.cached_property
    def _token_bytes(self) -> np.ndarray | None:
        return token_byte_counts(self.tokenizer)

    def __call__(
        self, store: TokenStore, documents: np.ndarray, objective, **shard
    ) -> EpochBatches:
        """`store`'s `documents` as batches of `objective`; `shard`: `EpochBatches`'s keywords."""
        if isinstance(objective, CausalLMObjective):
            # validation batches count the bytes of text they predict (for bits per byte)
            counts = self._token_bytes if shard["split"] == VAL else None
            return GPTBatches(store, documents, objective, token_bytes=counts, **shard)
        continuation = self._continuation if objective.whole_word_masking else None
        masker = MLMMasker(objective, self.special, self.vocab_size, continuation)
        return BertBatches(store, documents, objective, masker, self.special, **shard)


def too_few_documents(
    err: TooFewDocuments,
    tokens: int,
    val_tokens: int,
    corpus: str,
    *,
    pairs: bool,
    causal: bool,
    val_fraction: float,
    seq_len: int,
) -> str:
    """Why a corpus (`corpus`: its description) of `err.documents` documents (`tokens` in all) is
    too few for the run (`val_tokens`: the validation window; `pairs`: BERT's next-sentence
    pairs; `causal`: GPT windows of `seq_len`), and the data or settings (full Hydra keys) that
    make it work."""
    docs = err.documents
    have = f"the corpus ({corpus}) has {docs} document{'s' * (docs != 1)} ({tokens:,} tokens)"
    held_out = f"datamodule.val_fraction={val_fraction} holds out whole documents"
    if pairs:
        # half of NSP's pairs take their second sentence from another document of the split
        need = (
            "BERT's next-sentence prediction needs at least 2 documents per split (half of "
            "its pairs take the second sentence from another document)"
        )
        if val_fraction > 0:
            need += f": 2 for training and 2 for validation ({held_out})"
        if docs >= err.min_train:
            fix = "train without validation: datamodule.val_fraction=0"
        else:  # the masked LM alone trains on one document (and validates on another)
            fix = "train the masked LM alone: objective.next_sentence_prediction=false" + (
                " datamodule.val_fraction=0" if val_fraction > 0 else ""
            )
        least = err.min_train + (2 if val_fraction > 0 else 0)
        return f"{have}: {need}. Add documents ({least} or more in all), or {fix}"
    window = seq_len + 1
    if causal and tokens < window:
        # one window of all the text, and no validation, is what such a corpus allows
        without = " datamodule.val_fraction=0" if val_fraction > 0 else ""
        return (
            f"{have}: too little text for one training window of objective.seq_len + 1 = "
            f"{window} tokens. Add text, or train on one shorter window"
            f"{' without validation' if without else ''}: objective.seq_len={tokens - 1}"
            f"{without}"
        )
    return (
        f"{have}: validation needs at least 1 document and {val_tokens:,} tokens ({held_out})"
        f", here {err.held_out}, which leaves none for training. Add documents, or train "
        "without validation: datamodule.val_fraction=0"
    )
