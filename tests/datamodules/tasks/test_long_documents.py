"""Long documents in the fine-tuning datamodule: the seeded, stratified dev split carved out of
the long IMDB reviews, sliding-window batches of whole documents, per-epoch chunk sampling, and
the truncation baselines; unlabelled prediction files."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hydra.errors import InstantiationException

from datamodules.finetune import FinetuneDataModule
from datamodules.tasks.files import read_examples, stratified_holdout, task_examples
from datamodules.tasks.long_text import LongTextError, LongTextSpec, chunk_spans
from datamodules.tasks.spec import CARVED_DEV, Example
from tests.conftest import SHARED_DATA
from tests.datamodules.tasks.test_tasks import task_spec
from tokenizer import batched, special_ids, train_tokenizer

LONG_DOCS = SHARED_DATA / "long_docs"
pytestmark = pytest.mark.skipif(not LONG_DOCS.is_dir(), reason=f"no data at {LONG_DOCS}")


def imdb(*overrides: str):
    return task_spec("imdb_long", f"task.data_dir={LONG_DOCS}", *overrides)


@pytest.fixture(scope="module")
def wordpiece():
    texts = [e.texts[0] for e in read_examples(imdb(), "train", limit=200)]
    return train_tokenizer("wordpiece", batched(texts), 2000)


def test_carved_dev_split_is_stratified_disjoint_and_seeded():
    spec = imdb()
    train, dev = task_examples(spec, "train"), task_examples(spec, CARVED_DEV)
    everything = read_examples(spec, "train")
    assert len(train) + len(dev) == len(everything) == 2600
    assert not {e.id for e in train} & {e.id for e in dev}
    assert len(dev) == pytest.approx(0.2 * 2600, abs=2)
    counts, total = Counter(e.label for e in dev), Counter(e.label for e in everything)
    for label in total:
        assert counts[label] / total[label] == pytest.approx(0.2, abs=0.01)
    assert [e.id for e in task_examples(spec, CARVED_DEV)] == [e.id for e in dev]
    reseeded = task_examples(imdb("task.split_seed=7"), CARVED_DEV)
    assert {e.id for e in reseeded} != {e.id for e in dev}


def test_stratified_holdout_keeps_every_label_on_both_sides():
    examples = [Example(("t",), label, str(i)) for i, label in enumerate("aaaaaaaaabbccc")]
    held = stratified_holdout(examples, 0.1, seed=0)
    labels = Counter(examples[i].label for i in held)
    assert labels == {"a": 1, "b": 1, "c": 1}  # rounding gives b and c none; each keeps one
    regression = [Example(("t",), float(v), str(v)) for v in range(100)]
    picked = np.asarray([regression[i].label for i in stratified_holdout(regression, 0.2, 0)])
    assert len(picked) == 20 and all(np.histogram(picked, bins=4, range=(0, 100))[0] == 5)


def test_carving_conflicts_with_a_dev_file():
    with pytest.raises(InstantiationException, match="dev_fraction carves a 'dev' split"):
        imdb("+task.files.dev=imdb_long_train.jsonl")


def window_module(tokenizer, **long_text):
    spec = imdb(*(f"task.long_text.{k}={v}" for k, v in long_text.items()))
    dm = FinetuneDataModule(
        spec,
        tokenizer,
        max_seq_len=66,
        batch_size=3,
        eval_batch_size=4,
        max_examples=12,
        seed=5,
    )
    dm.setup()
    return dm


def test_window_batches_hold_every_chunk_of_whole_documents(wordpiece):
    dm = window_module(wordpiece, stride=48)
    ids = special_ids(wordpiece)
    batch = next(iter(dm.val_dataloader()[0]))
    docs = batch["example_index"].tolist()
    assert len(docs) == 4 and batch["labels"].shape == (4,)
    examples = dm.examples(CARVED_DEV)
    for position, doc in enumerate(docs):
        rows = batch["input_ids"][batch["chunk_doc"] == position]
        mask = batch["attention_mask"][batch["chunk_doc"] == position]
        content = wordpiece.encode(examples[doc].texts[0], add_special_tokens=False).ids
        spans = chunk_spans(len(content), 64, 48)
        assert len(rows) == len(spans) > 1  # the documents are longer than one window
        for row, row_mask, (start, end) in zip(rows, mask, spans, strict=True):
            n = int(row_mask.sum())
            assert row[:n].tolist() == [ids.cls, *content[start:end], ids.sep]
    assert batch["chunk_doc"].tolist() == sorted(batch["chunk_doc"].tolist())


def test_training_samples_chunks_per_document_anew_each_epoch(wordpiece):
    dm = window_module(wordpiece, stride=48, train_chunks=2)
    loader = dm.train_dataloader()

    def epoch(n):
        dm._sampler.set_epoch(n)
        picked = {}
        for batch in loader:
            assert Counter(batch["chunk_doc"].tolist()) == dict.fromkeys(
                range(len(batch["labels"])), 2
            )
            for position, doc in enumerate(batch["example_index"].tolist()):
                picked[doc] = batch["input_ids"][batch["chunk_doc"] == position][:, 1].tolist()
        return picked

    first, again, second = epoch(0), epoch(0), epoch(1)
    assert sorted(first) == list(range(len(dm.examples("train"))))
    assert first == again and first != second


def test_truncation_modes_keep_the_head_or_head_and_tail(wordpiece):
    spec = imdb(
        "task.long_text.mode=truncate",
        "task.long_text.truncate=head_tail",
        "task.long_text.head=10",
    )
    dm = FinetuneDataModule(spec, wordpiece, max_seq_len=34, max_examples=3)
    dm.setup()
    batch = next(iter(dm.val_dataloader()[0]))
    content = wordpiece.encode(dm.examples(CARVED_DEV)[0].texts[0], add_special_tokens=False).ids
    ids = special_ids(wordpiece)
    assert batch["input_ids"][0].tolist() == [ids.cls, *content[:10], *content[-22:], ids.sep]
    assert "chunk_doc" not in batch


def test_head_tail_keeps_a_quarter_by_default_and_checks_head(wordpiece):
    spec = imdb("task.long_text.mode=truncate", "task.long_text.truncate=head_tail")
    dm = FinetuneDataModule(spec, wordpiece, max_seq_len=42, max_examples=2)
    dm.setup()
    content = wordpiece.encode(dm.examples(CARVED_DEV)[0].texts[0], add_special_tokens=False).ids
    row = next(iter(dm.val_dataloader()[0]))["input_ids"][0].tolist()
    assert row[1:-1] == content[:10] + content[-30:]  # 40 tokens of room: 10 head, 30 tail
    too_long = imdb(
        "task.long_text.mode=truncate",
        "task.long_text.truncate=head_tail",
        "task.long_text.head=128",
    )
    dm = FinetuneDataModule(too_long, wordpiece, max_seq_len=42, max_examples=2)
    with pytest.raises(LongTextError, match="head=128 exceeds the 40 content tokens"):
        dm.setup()


def test_window_that_does_not_fit_is_rejected(wordpiece):
    spec = imdb("task.long_text.window=100")
    with pytest.raises(ValueError, match="does not fit max_seq_len"):
        FinetuneDataModule(spec, wordpiece, max_seq_len=66)


def test_long_text_spec_checks_its_values():
    with pytest.raises(ValueError, match="aggregate"):
        LongTextSpec(aggregate="median")
    with pytest.raises(ValueError, match="stride=80 exceeds the window"):
        LongTextSpec(stride=80).resolve(64)
    assert LongTextSpec().resolve(64) == (64, 48)


def test_prediction_file_is_read_without_labels(wordpiece, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "\n".join(json.dumps({"id": f"d{i}", "text": "good film " * 80}) for i in range(3))
    )
    spec = imdb()
    dm = FinetuneDataModule(
        spec,
        wordpiece,
        max_seq_len=66,
        predict_task=spec.prediction_spec(docs),
        label_map=None,
    )
    dm.setup("predict")
    assert dm.predict_splits == ["input"]
    batch = next(iter(dm.predict_dataloader()[0]))
    assert batch["labels"].tolist() == [-1, -1, -1]
    assert [e.id for e in dm.examples("input")] == ["d0", "d1", "d2"]
