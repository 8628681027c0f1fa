"""`FinetuneDataModule`: the LightningDataModule of fine-tuning on a `TaskSpec` task.

    dm = FinetuneDataModule(spec, tokenizer, max_seq_len=128)
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
    scored         (B,)   bool    only in a DDP rank's evaluation batch that holds a `Repeat`:
                                  False for the repeated examples, which are not scored

`train_dataloader()` reshuffles every epoch from (seed, epoch); `val_dataloader()` returns one
loader per evaluation split, in `eval_splits` order, so that MNLI matched and mismatched are never
mixed; `predict_dataloader()` one per unlabelled split of `predict_task` (labels -1, or NaN for
regression).

Several processes (DDP): the module shards its data itself (its samplers are
`DistributedSampler`s, which Lightning leaves as they are). Each rank trains on every
world-th example of the epoch's order and evaluates every world-th example of each split; a
rank whose share is one short repeats an example to keep the ranks' batch counts equal, and
marks it `Repeat` so that it is not scored: every evaluation example counts exactly once.

Pairs read apart (`siamese=True`, pair tasks): each text of a pair is its own sequence
(`[CLS] A [SEP]`, `[CLS] B [SEP]`; GPT `A <eot>`, `B <eot>`), and a batch of B pairs holds 2B
rows, rows 2i and 2i+1 the two texts of its i-th pair (`PairCollator`); `labels`,
`example_index` and `scored` stay one per pair.

Long documents (`task.long_text`, single-text tasks): in "truncate" mode each document is cut
to one sequence (head, or head+tail) and batched as above. In "window" mode each document
becomes its sliding-window chunks, and a batch holds whole documents (`batch_size` documents,
all of their chunks, or `train_chunks` sampled ones per document when training):
    input_ids, attention_mask, token_type_ids   (N, T) one row per chunk
    chunk_doc      (N,)   int64   the batch document (0..M-1) each chunk belongs to
    labels         (M,)           one per document
    example_index  (M,)   int64   position of each document in its split
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import lightning as L
import numpy as np
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from datamodules.tasks.batches import (
    ChunkCollator,
    ChunkedSplit,
    EncodedSplit,
    EpochShuffleSampler,
    EvalShardSampler,
    PadCollator,
    PairCollator,
    PairedSplit,
)
from datamodules.tasks.files import read_examples, task_examples
from datamodules.tasks.labels import LabelMap, build_label_map
from datamodules.tasks.long_text import chunk_document, truncate
from datamodules.tasks.spec import Example, TaskDataError, TaskSpec
from tokenizer import TEMPLATE_BY_KIND, InputTemplate, special_ids, tokenizer_kind

log = logging.getLogger(__name__)


def task_tokenizer(tokenizer: Tokenizer, max_seq_len: int, template: InputTemplate) -> Tokenizer:
    """A copy of `tokenizer` that adds the task template and truncates to `max_seq_len`.

    The caller's tokenizer is left untouched (it is shared with other components).
    """
    special_ids(tokenizer)  # fail early, with the fix, when special tokens are missing
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_padding()
    template.apply(copy)
    copy.enable_truncation(max_length=max_seq_len, strategy="longest_first")
    return copy


class FinetuneDataModule(L.LightningDataModule):
    """Training and evaluation data of a fine-tuning task.

    Args:
        task: the task (`conf/task/*.yaml`).
        tokenizer: the model's tokenizer (not modified): WordPiece (BERT) or BPE (GPT).
        max_seq_len: tokens per sequence, special tokens included.
        batch_size: training batch size.
        eval_batch_size: evaluation batch size.
        num_workers: DataLoader worker processes.
        seed: seed of the per-epoch training order.
        max_examples: read only the first this many examples of each split (quick runs, tests);
            with `task.labels` null, labels are then collected from those examples only.
        train_examples: train on a fixed random sample of this many training examples
            (`datamodules.tasks.files.fixed_sample`; the same for every seed); the evaluation
            splits are read whole. None: all of them.
        eval_examples: score on a fixed random sample of this many examples of each
            evaluation split (a probe's quick estimate); None: all of them.
        predict_task: the spec of the unlabelled splits served by `predict_dataloader()`
            (`TaskSpec.prediction_spec()`); None: none.
        label_map: the label map to use (a fine-tuned model's); None: from the task.
        siamese: encode the two texts of a pair apart (`PairedSplit`), for a siamese head;
            ignored by single-text tasks.
        template: the special tokens around the texts (the model family's
            `Family.input_template`); None: the template of the tokenizer's kind.
    """

    def __init__(
        self,
        task: TaskSpec,
        tokenizer: Tokenizer,
        *,
        max_seq_len: int = 128,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 1234,
        max_examples: int | None = None,
        train_examples: int | None = None,
        eval_examples: int | None = None,
        predict_task: TaskSpec | None = None,
        label_map: LabelMap | None = None,
        siamese: bool = False,
        template: InputTemplate | None = None,
    ) -> None:
        super().__init__()
        self.template = (
            TEMPLATE_BY_KIND[tokenizer_kind(tokenizer)] if template is None else template
        )
        self.siamese = siamese and task.is_pair
        if task.long_text is not None and task.is_pair:
            raise TaskDataError(
                f"task {task.name!r}: task.long_text handles single-text tasks; this task has "
                f"two text columns {task.text_columns}. Set task.long_text=null"
            )
        # [CLS] A [SEP] (B [SEP]) for BERT; A <eot> (B <eot>) for GPT (the family's template,
        # else the one the tokenizer's kind is made with); one text a row if siamese
        texts = 1 if self.siamese else len(task.text_columns)
        specials = self.template.special_count(texts)
        floor = specials + texts
        if max_seq_len < floor:
            raise TaskDataError(
                f"datamodule.max_seq_len={max_seq_len} leaves no room for the texts of task {task.name!r}: "
                f"it needs at least {floor} ({specials} special tokens and one token per text)"
            )
        if batch_size < 1 or eval_batch_size < 1:
            raise TaskDataError(
                f"datamodule.batch_size={batch_size} and eval_batch_size={eval_batch_size} "
                "must be >= 1"
            )
        self.task = task
        self.max_seq_len, self.batch_size, self.eval_batch_size = (
            max_seq_len,
            batch_size,
            eval_batch_size,
        )
        self.num_workers, self.seed, self.max_examples = num_workers, seed, max_examples
        self.train_examples, self.eval_examples = train_examples, eval_examples
        self._tokenizer = task_tokenizer(tokenizer, max_seq_len, self.template)
        ids = special_ids(tokenizer)
        self.pad_id = ids.pad
        # put around every long-text chunk (the task template's specials)
        self._wrap = self.template.wrap_ids(tokenizer)
        self.predict_task = predict_task
        self._examples: dict[str, list[Example]] = {}
        self._encoded: dict[str, EncodedSplit | ChunkedSplit | PairedSplit] = {}
        self._label_map: LabelMap | None = label_map
        self._sampler: EpochShuffleSampler | None = None
        if task.long_text is not None:
            self.window, self.stride = task.long_text.resolve(
                max_seq_len - sum(len(w) for w in self._wrap)
            )

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

    def regression_target(self) -> tuple[float, float]:
        """(mean, std) of the training split's targets for a regression task, which the head
        predicts in standardized form; (0, 1) for classification or constant targets."""
        if not self.task.is_regression:
            return (0.0, 1.0)
        targets = self._split(self.task.train_split).labels
        std = float(targets.std())
        return (float(targets.mean()), std if std > 0 else 1.0)

    @property
    def predict_splits(self) -> list[str]:
        """Names of the unlabelled splits, in `predict_dataloader()` order."""
        return list(self.predict_task.files) if self.predict_task is not None else []

    @property
    def sequence_length(self) -> int:
        """The longest sequence a batch can hold, special tokens included: `max_seq_len`, or
        for sliding windows a window and the special tokens around it."""
        if not self.chunked:
            return self.max_seq_len
        return self.window + sum(len(w) for w in self._wrap)

    @property
    def chunked(self) -> bool:
        """Whether batches hold sliding-window chunks of documents (`chunk_doc` in the batch)."""
        return self.task.long_text is not None and self.task.long_text.mode == "window"

    def examples(self, split: str) -> list[Example]:
        """The examples of a split read by `setup()` (`example_index` indexes this list)."""
        return self._examples[split]

    # --- Lightning hooks ------------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        """Read and encode the splits `stage` needs (all labelled ones when None); idempotent."""
        if stage == "predict":
            for split in self.predict_splits:
                if split not in self._encoded:
                    assert self.predict_task is not None
                    self._examples[split] = read_examples(
                        self.predict_task, split, labelled=False, limit=self.max_examples
                    )
                    self._check_not_empty(self.predict_task, split)
                    self._encoded[split] = self._encode(split, labelled=False)
            return
        train = self.task.train_split
        needed = [] if stage in ("validate", "test") else [train]
        needed += [s for s in self.eval_splits if s not in needed]
        if self._label_map is None and self.task.labels is None and not self.task.is_regression:
            self._read(train, labels_known=False)  # the labels come from the training file
            self._label_map = build_label_map(self.task, self._examples[train])
        for split in needed:
            self._read(split, labels_known=True)
            if split not in self._encoded:
                self._encoded[split] = self._encode(split)

    def process_share(self) -> tuple[int, int]:
        """(rank, world size) of the trainer this module is attached to; (0, 1) outside one."""
        trainer = self.trainer
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def train_dataloader(self) -> DataLoader:
        split = self._split(self.task.train_split)
        rank, world = self.process_share()
        sampler = self._sampler
        if sampler is None or (sampler.n, sampler.rank, sampler.num_replicas) != (
            len(split),
            rank,
            world,
        ):
            self._sampler = EpochShuffleSampler(
                len(split), self.seed, with_epoch=self.chunked, rank=rank, world=world
            )
        return DataLoader(
            split,
            batch_size=self.batch_size,
            sampler=self._sampler,
            collate_fn=self._collator(split),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> list[DataLoader]:
        return [self.eval_loader(s) for s in self.eval_splits]

    def predict_dataloader(self) -> list[DataLoader]:
        return [self.eval_loader(s) for s in self.predict_splits]

    def eval_loader(self, name: str, sample: int | None = None) -> DataLoader:
        """An in-order loader of a split read by `setup()` (any split: a probe reads the
        training split in order too). `sample`: only that many of its items, a fixed random
        choice (seed 0) kept in order, all in this process."""
        split = self._split(name)
        rank, world = self.process_share()
        sampler: Iterable[int] = EvalShardSampler(len(split), rank=rank, world=world)
        if sample is not None and sample < len(split):
            sampler = sorted(
                np.random.default_rng(0).choice(len(split), sample, replace=False).tolist()
            )
        return DataLoader(
            split,
            batch_size=self.eval_batch_size,
            sampler=sampler,
            collate_fn=self._collator(split),
            num_workers=self.num_workers,
        )

    def _collator(self, split: EncodedSplit | ChunkedSplit | PairedSplit):
        if isinstance(split, PairedSplit):
            return PairCollator(split, self.pad_id)
        if isinstance(split, ChunkedSplit):
            assert self.task.long_text is not None
            return ChunkCollator(split, self.pad_id, self.seed, self.task.long_text.train_chunks)
        return PadCollator(split, self.pad_id)

    # --- reading and encoding -------------------------------------------------------------------

    def _split(self, name: str) -> EncodedSplit | ChunkedSplit | PairedSplit:
        if name not in self._encoded:
            raise RuntimeError(f"split {name!r} is not loaded: call setup() first")
        return self._encoded[name]

    def _read(self, split: str, labels_known: bool) -> None:
        if split in self._examples:
            return
        # Before the label map exists (labels collected from the training file) any label
        # is accepted; afterwards a label outside the map is an error naming file and line.
        labels = self.label_map.labels if labels_known and not self.task.is_regression else None
        is_train = split == self.task.train_split
        sample = self.train_examples if is_train else self.eval_examples
        self._examples[split] = task_examples(
            self.task, split, labels=labels, limit=self.max_examples, sample=sample
        )
        self._check_not_empty(self.task, split)

    def _check_not_empty(self, task: TaskSpec, split: str) -> None:
        if not self._examples[split]:
            raise TaskDataError(
                f"task {task.name!r}: the {split} split ({task.source(split)}) has no examples"
            )

    def _labels(self, examples: list[Example], labelled: bool) -> np.ndarray:
        if self.task.is_regression:
            values = [e.label if labelled else np.nan for e in examples]
            return np.array(values, dtype=np.float32)
        to_id = self.label_to_id
        return np.array([to_id[e.label] if labelled else -1 for e in examples], dtype=np.int64)

    def _encode(
        self, split: str, labelled: bool = True
    ) -> EncodedSplit | ChunkedSplit | PairedSplit:
        examples = self._examples[split]
        labels = self._labels(examples, labelled)
        if self.task.long_text is not None:
            return self._encode_long(split, examples, labels)
        if self.siamese:  # each text its own sequence, rows 2i and 2i+1 for example i
            firsts = self._tokenizer.encode_batch([e.texts[0] for e in examples])
            seconds = self._tokenizer.encode_batch([e.texts[1] for e in examples])
            encodings = [enc for pair in zip(firsts, seconds, strict=True) for enc in pair]
        else:
            inputs = [e.texts if len(e.texts) == 2 else e.texts[0] for e in examples]
            encodings = self._tokenizer.encode_batch(inputs)
        ids = [enc.ids for enc in encodings]
        type_ids = [enc.type_ids for enc in encodings]  # all 0 unless the template has segments
        truncated = sum(len(x) >= self.max_seq_len for x in ids)
        log.info(
            "%s/%s: %d examples encoded%s, %d sequences at max_seq_len=%d (possibly truncated)",
            self.task.name,
            split,
            len(examples),
            " (texts apart)" if self.siamese else "",
            truncated,
            self.max_seq_len,
        )
        if self.siamese:
            return PairedSplit(EncodedSplit(ids, type_ids, np.repeat(labels, 2)), labels)
        return EncodedSplit(ids, type_ids, labels)

    def _encode_long(
        self, split: str, examples: list[Example], labels: np.ndarray
    ) -> EncodedSplit | ChunkedSplit:
        """Documents as truncated single sequences, or as their sliding-window chunks."""
        spec = self.task.long_text
        assert spec is not None
        prefix, suffix = self._wrap
        contents = self._content_ids(examples)
        if spec.mode == "truncate":
            room = self.max_seq_len - len(prefix) - len(suffix)
            head = spec.head_tokens(room)
            ids = [prefix + truncate(c, room, spec.truncate, head) + suffix for c in contents]
            log.info(
                "%s/%s: %d documents truncated (%s)", self.task.name, split, len(ids), spec.truncate
            )
            return EncodedSplit(ids, [[0] * len(x) for x in ids], labels)
        chunks = [chunk_document(c, prefix, suffix, self.window, self.stride) for c in contents]
        per_doc = np.array([len(c) for c in chunks], dtype=np.int64)
        rows = [row for doc in chunks for row in doc]
        chunk_labels = np.repeat(labels, per_doc)
        log.info(
            "%s/%s: %d documents -> %d chunks (window %d, stride %d; %.1f per document)",
            self.task.name,
            split,
            len(chunks),
            len(rows),
            self.window,
            self.stride,
            per_doc.mean(),
        )
        return ChunkedSplit(
            EncodedSplit(rows, [[0] * len(r) for r in rows], chunk_labels), per_doc, labels
        )

    def _content_ids(self, examples: list[Example]) -> list[list[int]]:
        """Each document's tokens without special tokens and without truncation."""
        encoder = Tokenizer.from_str(self._tokenizer.to_str())
        encoder.no_truncation()
        encodings = encoder.encode_batch([e.texts[0] for e in examples], add_special_tokens=False)
        return [enc.ids for enc in encodings]
