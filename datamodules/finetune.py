"""`FinetuneDataModule`: the LightningDataModule of fine-tuning on a `TaskSpec` task.

    dm = FinetuneDataModule(spec, tokenizer, "wordpiece", max_seq_len=128)
    dm.setup()
    dm.num_labels, dm.label_to_id, dm.eval_splits     # e.g. 3, {...}, ["dev_matched", ...]
    trainer.fit(module, datamodule=dm)

`setup()` reads the training split and every evaluation split and encodes them once with the
fast batch encoder:
- WordPiece (BERT): `[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]`, token types 0 for `[CLS] A [SEP]`
  and 1 for `B [SEP]`.
- BPE (GPT): `A <eot>` or `A <eot> B <eot>`, token types all 0; the closing end-of-text token is
  the last real token, which a GPT classification head reads.
Texts are truncated to `max_seq_len` (special tokens included) longest-first, so a short segment
of a pair is kept whole and both segments always keep tokens.

Batches (T = longest sequence of the batch, right padding with the tokenizer's pad id):
    input_ids      (B, T) int64
    attention_mask (B, T) int64   1 for real tokens, 0 for padding
    token_type_ids (B, T) int64   0 for padding
    labels         (B,)   int64 class ids, or float32 targets for regression
    example_index  (B,)   int64   position of the example in its split (`examples(split)`)

`train_dataloader()` reshuffles every epoch from (seed, epoch); `val_dataloader()` returns one
loader per evaluation split, in `eval_splits` order, so that MNLI matched and mismatched are never
mixed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer, processors
from torch.utils.data import DataLoader, Dataset, Sampler

from datamodules.tasks import (
    Example,
    LabelMap,
    TaskDataError,
    TaskSpec,
    build_label_map,
    read_examples,
)
from tokenizer import special_ids
from tokenizer.build import add_bert_template
from tokenizer.special import EOT

log = logging.getLogger(__name__)


def task_tokenizer(tokenizer: Tokenizer, kind: str, max_seq_len: int) -> Tokenizer:
    """A copy of `tokenizer` that adds the task template and truncates to `max_seq_len`.

    The caller's tokenizer is left untouched (it is shared with other components).
    """
    special_ids(tokenizer, kind)  # fail early, with the fix, when special tokens are missing
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_padding()
    if kind == "wordpiece":
        add_bert_template(copy)
    else:
        eot_id = copy.token_to_id(EOT)
        copy.post_processor = processors.TemplateProcessing(
            single=f"$A:0 {EOT}:0",
            pair=f"$A:0 {EOT}:0 $B:0 {EOT}:0",
            special_tokens=[(EOT, eot_id)],
        )
    copy.enable_truncation(max_length=max_seq_len, strategy="longest_first")
    return copy


class EncodedSplit(Dataset):
    """The encoded examples of one split, as flat token arrays plus offsets.

    Items are example indices; `PadCollator` turns a list of them into a batch.
    """

    def __init__(self, ids: list[list[int]], type_ids: list[list[int]], labels: np.ndarray):
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.ids = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=lengths.sum())
        self.type_ids = np.fromiter(
            (t for x in type_ids for t in x), dtype=np.int8, count=lengths.sum()
        )
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> int:
        return index

    def length(self, index: int) -> int:
        return int(self.offsets[index + 1] - self.offsets[index])


class PadCollator:
    """Builds a right-padded batch (padded to its longest sequence) from example indices."""

    def __init__(self, split: EncodedSplit, pad_id: int) -> None:
        self.split, self.pad_id = split, pad_id

    def __call__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        split = self.split
        starts, ends = split.offsets[indices], split.offsets[np.asarray(indices) + 1]
        width = int((ends - starts).max())
        input_ids = np.full((len(indices), width), self.pad_id, dtype=np.int64)
        type_ids = np.zeros((len(indices), width), dtype=np.int64)
        mask = np.zeros((len(indices), width), dtype=np.int64)
        for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
            n = end - start
            input_ids[row, :n] = split.ids[start:end]
            type_ids[row, :n] = split.type_ids[start:end]
            mask[row, :n] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(mask),
            "token_type_ids": torch.from_numpy(type_ids),
            "labels": torch.from_numpy(split.labels[indices]),
            "example_index": torch.as_tensor(indices, dtype=torch.int64),
        }


class EpochShuffleSampler(Sampler[int]):
    """A permutation of range(n) that is a pure function of (seed, epoch).

    Lightning calls `set_epoch` before each training epoch; used outside Lightning, each
    iteration moves on to the next epoch's order by itself.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        self.epoch += 1
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.n


class FinetuneDataModule(L.LightningDataModule):
    """Training and evaluation data of a fine-tuning task.

    Args:
        task: the task (`conf/task/*.yaml`).
        tokenizer: the model's tokenizer (not modified).
        tokenizer_kind: "wordpiece" (BERT) or "bpe" (GPT).
        max_seq_len: tokens per sequence, special tokens included.
        batch_size: training batch size.
        eval_batch_size: evaluation batch size.
        num_workers: DataLoader worker processes.
        seed: seed of the per-epoch training order.
        max_examples: read only the first this many examples of each split (quick runs, tests);
            with `task.labels` null, labels are then collected from those examples only.
    """

    def __init__(
        self,
        task: TaskSpec,
        tokenizer: Tokenizer,
        tokenizer_kind: str,
        *,
        max_seq_len: int = 128,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 1234,
        max_examples: int | None = None,
    ) -> None:
        super().__init__()
        if tokenizer_kind not in ("wordpiece", "bpe"):
            raise ValueError(f"tokenizer_kind={tokenizer_kind!r} is not one of wordpiece, bpe")
        # [CLS] A [SEP] (B [SEP]) for BERT; A <eot> (B <eot>) for GPT
        specials = (
            (3 if task.is_pair else 2) if tokenizer_kind == "wordpiece" else len(task.text_columns)
        )
        floor = specials + len(task.text_columns)
        if max_seq_len < floor:
            raise ValueError(
                f"max_seq_len={max_seq_len} leaves no room for the texts of task {task.name!r}: "
                f"it needs at least {floor} ({specials} special tokens and one token per text)"
            )
        if batch_size < 1 or eval_batch_size < 1:
            raise ValueError(
                f"batch_size={batch_size} and eval_batch_size={eval_batch_size} must be >= 1"
            )
        self.task, self.tokenizer_kind = task, tokenizer_kind
        self.max_seq_len, self.batch_size, self.eval_batch_size = (
            max_seq_len,
            batch_size,
            eval_batch_size,
        )
        self.num_workers, self.seed, self.max_examples = num_workers, seed, max_examples
        self._tokenizer = task_tokenizer(tokenizer, tokenizer_kind, max_seq_len)
        self.pad_id = special_ids(tokenizer, tokenizer_kind).pad
        self._examples: dict[str, list[Example]] = {}
        self._encoded: dict[str, EncodedSplit] = {}
        self._label_map: LabelMap | None = None
        self._sampler: EpochShuffleSampler | None = None

    # --- what the LightningModule needs to know ------------------------------------------------

    @property
    def eval_splits(self) -> list[str]:
        """Names of the evaluation splits, in `val_dataloader()` order."""
        return list(self.task.eval_splits)

    @property
    def label_map(self) -> LabelMap:
        if self._label_map is None:
            if self.task.labels is None and not self.task.is_regression:
                raise RuntimeError(
                    f"task {self.task.name!r} collects its labels from the training file: "
                    "call setup() first"
                )
            self._label_map = build_label_map(self.task)
        return self._label_map

    @property
    def label_to_id(self) -> dict[str, int]:
        return self.label_map.label_to_id

    @property
    def num_labels(self) -> int:
        return self.label_map.num_labels

    def examples(self, split: str) -> list[Example]:
        """The examples of a split read by `setup()` (`example_index` indexes this list)."""
        return self._examples[split]

    # --- Lightning hooks ------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        """Read and encode the splits `stage` needs (all of them when None); idempotent."""
        train = self.task.train_split
        needed = [] if stage in ("validate", "test", "predict") else [train]
        needed += [s for s in self.eval_splits if s not in needed]
        if self._label_map is None and self.task.labels is None and not self.task.is_regression:
            self._read(train, labels_known=False)  # the labels come from the training file
            self._label_map = build_label_map(self.task, self._examples[train])
        for split in needed:
            self._read(split, labels_known=True)
            if split not in self._encoded:
                self._encoded[split] = self._encode(split)

    def train_dataloader(self) -> DataLoader:
        split = self._split(self.task.train_split)
        if self._sampler is None or self._sampler.n != len(split):
            self._sampler = EpochShuffleSampler(len(split), self.seed)
        return DataLoader(
            split,
            batch_size=self.batch_size,
            sampler=self._sampler,
            collate_fn=PadCollator(split, self.pad_id),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> list[DataLoader]:
        return [self._eval_loader(s) for s in self.eval_splits]

    def _eval_loader(self, name: str) -> DataLoader:
        split = self._split(name)
        return DataLoader(
            split,
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=PadCollator(split, self.pad_id),
            num_workers=self.num_workers,
        )

    # --- reading and encoding -------------------------------------------------------------------

    def _split(self, name: str) -> EncodedSplit:
        if name not in self._encoded:
            raise RuntimeError(f"split {name!r} is not loaded: call setup() first")
        return self._encoded[name]

    def _read(self, split: str, labels_known: bool) -> None:
        if split in self._examples:
            return
        # Before the label map exists (labels collected from the training file) any label
        # is accepted; afterwards a label outside the map is an error naming file and line.
        labels = self.label_map.labels if labels_known and not self.task.is_regression else None
        self._examples[split] = read_examples(
            self.task, split, labels=labels, limit=self.max_examples
        )
        if not self._examples[split]:
            raise TaskDataError(
                f"task {self.task.name!r}: the {split} file {self.task.path(split)} has no examples"
            )

    def _encode(self, split: str) -> EncodedSplit:
        examples = self._examples[split]
        inputs = [e.texts if len(e.texts) == 2 else e.texts[0] for e in examples]
        encodings = self._tokenizer.encode_batch(inputs)
        ids = [enc.ids for enc in encodings]
        if self.tokenizer_kind == "wordpiece":
            type_ids = [enc.type_ids for enc in encodings]
        else:
            type_ids = [[0] * len(x) for x in ids]
        if self.task.is_regression:
            labels = np.array([e.label for e in examples], dtype=np.float32)
        else:
            to_id = self.label_to_id
            labels = np.array([to_id[e.label] for e in examples], dtype=np.int64)
        truncated = sum(len(x) >= self.max_seq_len for x in ids)
        log.info(
            "%s/%s: %d examples encoded, %d at max_seq_len=%d (possibly truncated)",
            self.task.name,
            split,
            len(examples),
            truncated,
            self.max_seq_len,
        )
        return EncodedSplit(ids, type_ids, labels)
