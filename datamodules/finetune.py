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
from collections.abc import Iterable, Iterator, Sequence

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer, processors
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from datamodules.long_text import chunk_document, sample_chunks, truncate
from datamodules.task_files import Example, read_examples, task_examples
from datamodules.tasks import LabelMap, TaskDataError, TaskSpec, build_label_map
from tokenizer import special_ids, tokenizer_kind
from tokenizer.build import add_bert_template
from tokenizer.special import EOT

log = logging.getLogger(__name__)


def task_tokenizer(tokenizer: Tokenizer, max_seq_len: int) -> Tokenizer:
    """A copy of `tokenizer` that adds the task template and truncates to `max_seq_len`.

    The caller's tokenizer is left untouched (it is shared with other components).
    """
    special_ids(tokenizer)  # fail early, with the fix, when special tokens are missing
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_padding()
    if tokenizer_kind(tokenizer) == "wordpiece":
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

    def __call__(self, items: Sequence[int]) -> dict[str, torch.Tensor]:
        split = self.split
        indices = np.fromiter(items, dtype=np.int64, count=len(items))
        starts, ends = split.offsets[indices], split.offsets[indices + 1]
        width = int((ends - starts).max())
        input_ids = np.full((len(indices), width), self.pad_id, dtype=np.int64)
        type_ids = np.zeros((len(indices), width), dtype=np.int64)
        mask = np.zeros((len(indices), width), dtype=np.int64)
        for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
            n = end - start
            input_ids[row, :n] = split.ids[start:end]
            type_ids[row, :n] = split.type_ids[start:end]
            mask[row, :n] = 1
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(mask),
            "token_type_ids": torch.from_numpy(type_ids),
            "labels": torch.from_numpy(split.labels[indices]),
            "example_index": torch.from_numpy(indices),
        }
        return with_scored(batch, items)


class ChunkedSplit(Dataset):
    """The sliding-window chunks of one split's documents: chunk rows in an `EncodedSplit`
    (document order) and each document's range of chunk rows.

    Items are document indices, or (document, epoch) pairs from a training sampler;
    `ChunkCollator` turns a list of them into a batch.
    """

    def __init__(self, chunks: EncodedSplit, chunks_per_doc: np.ndarray, labels: np.ndarray):
        self.chunks = chunks
        self.doc_offsets = np.concatenate([[0], np.cumsum(chunks_per_doc)])
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return index

    def doc_chunks(self, doc: int) -> range:
        return range(int(self.doc_offsets[doc]), int(self.doc_offsets[doc + 1]))


class ChunkCollator:
    """A batch of whole documents: all their chunks, or `train_chunks` of each sampled from
    (seed, epoch, document) when the items carry the epoch (training)."""

    def __init__(
        self, split: ChunkedSplit, pad_id: int, seed: int, train_chunks: int | None
    ) -> None:
        self.split, self.seed, self.train_chunks = split, seed, train_chunks
        self.pad = PadCollator(split.chunks, pad_id)

    def __call__(self, items: Sequence[int | tuple[int, int]]) -> dict[str, torch.Tensor]:
        rows: list[int] = []
        chunk_doc: list[int] = []
        docs: list[int] = []
        for position, item in enumerate(items):
            doc, epoch = item if isinstance(item, tuple) else (item, None)
            chunks = self.split.doc_chunks(doc)
            if epoch is not None and self.train_chunks is not None:
                rng = np.random.default_rng([self.seed, epoch, doc])
                chunks = [chunks[i] for i in sample_chunks(len(chunks), self.train_chunks, rng)]
            rows.extend(chunks)
            chunk_doc.extend([position] * len(chunks))
            docs.append(doc)
        batch = self.pad(rows)
        batch["chunk_doc"] = torch.as_tensor(chunk_doc, dtype=torch.int64)
        batch["labels"] = torch.from_numpy(self.split.labels[docs])
        batch["example_index"] = torch.as_tensor(docs, dtype=torch.int64)
        return with_scored(batch, items)


class PairedSplit(Dataset):
    """The examples of a pair task with their two texts encoded apart (a siamese head): rows
    2i and 2i+1 of `texts` are the texts of example i. Items are example indices;
    `PairCollator` turns a list of them into a batch of 2B rows."""

    def __init__(self, texts: EncodedSplit, labels: np.ndarray) -> None:
        self.texts, self.labels = texts, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> int:
        return index


class PairCollator:
    """A batch of B pairs as 2B right-padded rows (each pair's two texts side by side), with
    one label and `example_index` per pair."""

    def __init__(self, split: PairedSplit, pad_id: int) -> None:
        self.split = split
        self.pad = PadCollator(split.texts, pad_id)

    def __call__(self, items: Sequence[int]) -> dict[str, torch.Tensor]:
        examples = np.fromiter(items, dtype=np.int64, count=len(items))
        batch = self.pad(np.stack([2 * examples, 2 * examples + 1], axis=1).reshape(-1).tolist())
        batch["labels"] = torch.from_numpy(self.split.labels[examples])
        batch["example_index"] = torch.from_numpy(examples)
        return with_scored(batch, items)


# --- sharding across processes (DDP) ---------------------------------------------------------------


class Repeat(int):
    """An example index that a rank's evaluation share repeats only so that every rank runs
    the same number of batches; it is batched like any other and not scored."""


def with_scored(batch: dict[str, torch.Tensor], items: Sequence) -> dict[str, torch.Tensor]:
    """`batch` with a `scored` mask (False for `Repeat` items) if any item is a `Repeat`."""
    if any(isinstance(item, Repeat) for item in items):
        batch["scored"] = torch.tensor([not isinstance(item, Repeat) for item in items])
    return batch


def rank_share(items: list, rank: int, world: int, repeat=lambda item: item) -> list:
    """Rank `rank`'s share of `items` among `world` processes: every world-th item from
    position `rank`, after `items` is padded to a multiple of `world` with its own first
    items (each passed through `repeat`), so that every rank gets ceil(len / world) items."""
    short = -len(items) % world
    padded = items + [repeat(items[i % len(items)]) for i in range(short)]
    return padded[rank::world]


class EpochShuffleSampler(DistributedSampler):
    """A permutation of range(n) that is a pure function of (seed, epoch), shared out among
    `world` processes (`rank_share`; the permutation is the same on every rank). Its length,
    ceil(n / world), is `DistributedSampler`'s.

    Lightning calls `set_epoch` before each training epoch; used outside Lightning, each
    iteration moves on to the next epoch's order by itself. With `with_epoch`, items are
    (index, epoch) pairs (for per-epoch chunk sampling in the collator, also in workers).
    """

    def __init__(
        self, n: int, seed: int, with_epoch: bool = False, *, rank: int = 0, world: int = 1
    ) -> None:
        super().__init__(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        self.n, self.with_epoch = n, with_epoch

    def __iter__(self) -> Iterator:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist()
        epoch = self.epoch
        self.epoch += 1
        items = [(i, epoch) for i in order] if self.with_epoch else order
        return iter(rank_share(items, self.rank, self.num_replicas))


class EvalShardSampler(DistributedSampler):
    """range(n) in order, shared out among `world` processes (`rank_share`); the items a rank
    repeats to fill its share are `Repeat`s, so that every example is scored exactly once."""

    def __init__(self, n: int, *, rank: int = 0, world: int = 1) -> None:
        super().__init__(range(n), num_replicas=world, rank=rank, shuffle=False)
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(rank_share(list(range(self.n)), self.rank, self.num_replicas, Repeat))


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
            (`datamodules.task_files.fixed_sample`; the same for every seed); the evaluation
            splits are read whole. None: all of them.
        eval_examples: score on a fixed random sample of this many examples of each
            evaluation split (a probe's quick estimate); None: all of them.
        predict_task: the spec of the unlabelled splits served by `predict_dataloader()`
            (`TaskSpec.prediction_spec()`); None: none.
        label_map: the label map to use (a fine-tuned model's); None: from the task.
        siamese: encode the two texts of a pair apart (`PairedSplit`), for a siamese head;
            ignored by single-text tasks.
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
    ) -> None:
        super().__init__()
        self.tokenizer_kind = tokenizer_kind(tokenizer)
        self.siamese = siamese and task.is_pair
        if task.long_text is not None and task.is_pair:
            raise TaskDataError(
                f"task {task.name!r}: task.long_text handles single-text tasks; this task has "
                f"two text columns {task.text_columns}. Set task.long_text=null"
            )
        # [CLS] A [SEP] (B [SEP]) for BERT; A <eot> (B <eot>) for GPT; one text a row if siamese
        texts = 1 if self.siamese else len(task.text_columns)
        specials = 1 + texts if self.tokenizer_kind == "wordpiece" else texts
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
        self._tokenizer = task_tokenizer(tokenizer, max_seq_len)
        ids = special_ids(tokenizer)
        self.pad_id = ids.pad
        # put around every long-text chunk (the task template's specials)
        self._wrap = (
            ([ids.cls], [ids.sep]) if self.tokenizer_kind == "wordpiece" else ([], [ids.eot])
        )
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
        if self.tokenizer_kind == "wordpiece":
            type_ids = [enc.type_ids for enc in encodings]
        else:
            type_ids = [[0] * len(x) for x in ids]
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
