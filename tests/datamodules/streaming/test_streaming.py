"""Streaming (`datamodule.streaming=true`, datamodules/streaming/read.py, stream_loader.py): the
streamed GPT windows are the store's packed stream, cut in shuffled blocks with nothing skipped;
BERT pairs come from training documents; resume is exact with 0 and 2 workers and through a
Lightning checkpoint; a changed setup and a too-small corpus are refused with the fix."""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from datamodules.corpora.corpus import CorpusError, DataSetupError, ParquetCorpus, TextFilesCorpus
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.pretrain import PretrainDataModule
from datamodules.streaming import loader as stream_loader
from datamodules.streaming.loader import _SETTINGS_MEANING
from datamodules.streaming.read import Cursor, ReaderState, held_out_count, stream_units
from pipeline.pretrain.checks import check_config
from pipeline.run.errors import ConfigError
from tests.conftest import ListCorpus, compose_pretrain
from tests.datamodules.test_resume import fit, same
from tests.pipeline.task_data import point_shipped_corpora_at

SETTINGS = {
    "bert": ("wordpiece", MaskedLMObjective(seq_len=32, batch_size=4)),
    "gpt": ("bpe", CausalLMObjective(seq_len=32, batch_size=4)),
}
BUFFER_MB = 0.006  # blocks of ~10-20 steps: the tests cross several blocks


@pytest.fixture(scope="module")
def paragraphs(embedded, tmp_path_factory) -> TextFilesCorpus:
    """The embedded corpus's paragraphs as documents, in three files of about 1 MB."""
    folder = tmp_path_factory.mktemp("paragraphs")
    texts = [p for doc in embedded.documents() for p in doc.split("\n") if len(p) > 200]
    for number in range(3):
        (folder / f"part{number}.txt").write_text("\n\n".join(texts[number::3]) + "\n")
    return TextFilesCorpus(str(folder / "*.txt"), doc_split="blank_line")


@pytest.fixture
def make_dm(request, embedded, cache_dir):
    def make(model: str, num_workers: int = 0, seed: int = 5, **kwargs) -> PretrainDataModule:
        kind, objective = SETTINGS[model]
        tokenizer = request.getfixturevalue(kind)
        options = {"streaming": True, "shuffle_buffer_mb": BUFFER_MB} | kwargs
        return PretrainDataModule(
            kwargs.pop("corpus", embedded),
            tokenizer,
            objective,
            cache_dir,
            seed=seed,
            num_workers=num_workers,
            **{k: v for k, v in options.items() if k != "corpus"},
        )

    return make


def take(dm: PretrainDataModule, count: int) -> list[dict]:
    dm.setup("fit")
    iterator = iter(dm.train_dataloader())
    return [next(iterator) for _ in range(count)]


def test_units_give_every_reader_work_and_hold_out_rounds_up():
    assert stream_units(1, 4) == [(0, j, 4) for j in range(4)]
    assert stream_units(3, 2) == [(0, 0, 1), (1, 0, 1), (2, 0, 1)]
    assert held_out_count(100, 0.05, 2) == 5
    assert held_out_count(10, 0.05, 2) == 2
    assert held_out_count(10, 0.0, 2) == 0


def test_streamed_gpt_windows_are_the_store_stream_with_none_skipped(make_dm, gpt_store):
    dm = make_dm("gpt")
    dm.setup("fit")
    held_out = dm.stream.dataset.held_out
    assert held_out >= 1
    documents = range(held_out, gpt_store.num_documents)
    stream = np.concatenate([gpt_store.document(i) for i in documents]).astype(np.int64)
    twice = np.concatenate([stream, stream])  # one unit, read in the same order every epoch
    seq_len = SETTINGS["gpt"][1].seq_len
    rows, cursors = [], set()
    steps = dm.stream.dataset.steps(0, 0, ReaderState())
    while True:
        record, step = next(steps)
        if record.cursor.epoch > 0:
            break
        cursors.add(record.cursor)
        rows += [np.concatenate([b["input_ids"], b["targets"][:, -1:]], axis=1) for b in step]
    rows = np.concatenate(rows)
    expected = np.stack([twice[i * seq_len : i * seq_len + seq_len + 1] for i in range(len(rows))])
    assert len(cursors) > 3  # several blocks
    assert len(rows) * seq_len >= len(stream) - seq_len  # the whole epoch went through
    # the same windows (none skipped, none twice), in another order within each block
    assert sorted(map(bytes, rows)) == sorted(map(bytes, expected))
    assert not np.array_equal(rows, expected)


def test_streamed_bert_pairs_come_from_training_documents(make_dm, bert_store):
    dm = make_dm("bert")
    batches = take(dm, 12)
    held_out = dm.stream.dataset.held_out
    special = dm.special
    training = [bert_store.document(i) for i in range(held_out, bert_store.num_documents)]
    haystack = [doc.astype(np.uint32).tobytes() for doc in training]
    segments = 0
    for batch in batches:
        ids = batch["input_ids"].clone().view(-1)
        ids[batch["masked_positions"]] = batch["mlm_labels"]  # the text before masking
        for row in ids.view(batch["input_ids"].shape).numpy():
            seps = np.flatnonzero(row == special.sep)
            assert row[0] == special.cls and len(seps) == 2
            first = row[1 : seps[0]].astype(np.uint32).tobytes()
            assert any(first in doc for doc in haystack)
            segments += 1
    assert segments == 48
    labels = torch.cat([b["nsp_labels"] for b in batches])
    assert 0 < labels.float().mean() < 1  # both kinds of pair


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_stream_resume_gives_the_uninterrupted_steps(model, num_workers, make_dm, paragraphs):
    total, cut = 100, 67  # inside a later block: the resumed readers re-read it and skip
    full = take(make_dm(model, num_workers, corpus=paragraphs), total)
    first = make_dm(model, num_workers, corpus=paragraphs)
    head = take(first, cut)
    state = first.state_dict()
    assert state["streaming"]["step"] == cut
    resumed = make_dm(model, num_workers, corpus=paragraphs)
    resumed.load_state_dict(state)
    tail = take(resumed, total - cut)
    assert same(head, full[:cut])
    assert same(tail, full[cut:])
    cursors = {tuple(s["cursor"]) for s in state["streaming"]["readers_state"].values()}
    assert (0, 0, 0) not in cursors  # every reader was past its first block


def test_two_readers_split_an_epoch_of_documents_between_them(make_dm, paragraphs):
    dm = make_dm("gpt", 2, corpus=paragraphs)
    dm.setup("fit")
    dataset = dm.stream.dataset
    read = []
    for reader in (0, 1):
        epoch = []
        for text, after in dataset.documents(reader, Cursor()):
            if after.epoch > 0:
                break
            epoch.append(text)
        read.append(epoch)
    everything = list(paragraphs.documents())[dataset.held_out :]
    assert len(read[0]) > 10 and len(read[1]) > 10
    assert Counter(read[0]) + Counter(read[1]) == Counter(everything)  # each document once


@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_lightning_checkpoint_resumes_the_stream_exactly(model, make_dm, paragraphs, tmp_path):
    def make():
        return make_dm(model, num_workers=2, corpus=paragraphs)

    full = fit(make(), 30, tmp_path / "full")
    head = fit(make(), 13, tmp_path / "part", save_every=13)
    checkpoint = next((tmp_path / "part").glob("*.ckpt"))
    state = torch.load(checkpoint, weights_only=True)["PretrainDataModule"]
    assert state["streaming"]["step"] == 13
    tail = fit(make(), 30, tmp_path / "resumed", ckpt_path=checkpoint)
    assert head == full[:13]
    assert tail == full[13:]


def test_resume_refuses_other_workers_and_a_store_checkpoint(make_dm):
    first = make_dm("gpt", 0)
    take(first, 3)
    state = first.state_dict()
    other = make_dm("gpt", 2)
    other.load_state_dict(state)
    with pytest.raises(DataSetupError, match="readers=1, this run 2 \\(processes x datamodule"):
        other.setup("fit")
    assert set(other.stream.settings_key()) == set(_SETTINGS_MEANING)  # every one explained
    stored = make_dm("gpt", streaming=False)
    with pytest.raises(DataSetupError, match="datamodule.streaming=true"):
        stored.load_state_dict(state)


def test_the_streams_text_is_compared_in_one_place(make_dm, monkeypatch):
    """The position saves the corpus fingerprint, and a resume on other text is refused by
    `text_changed` (the store path's message), which alone judges the text: the settings
    compared beside it do not hold the fingerprint a second time."""
    first = make_dm("gpt", 0)
    take(first, 3)
    state = first.state_dict()
    assert state["streaming"]["corpus"] == first.stream.corpus_key
    assert "corpus" not in first.stream.settings_key()
    state["streaming"]["corpus"] = "0" * 16
    edited = make_dm("gpt", 0)
    edited.load_state_dict(state)
    with pytest.raises(DataSetupError, match=r"^cannot resume the data position: the corpus"):
        edited.setup("fit")
    monkeypatch.setattr(stream_loader, "text_changed", lambda saved, now, corpus: None)
    judged_same = make_dm("gpt", 0)
    judged_same.load_state_dict(state)
    judged_same.setup("fit")  # no second comparison of the corpus refuses it


def test_a_corpus_too_small_to_hold_out_validation_is_refused(make_dm, tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("A single short document. It has two sentences.\n")
    dm = make_dm("gpt", corpus=TextFilesCorpus(str(path)))
    with pytest.raises(DataSetupError, match="leaves none for training.*val_fraction"):
        dm.check_documents()


def test_bad_text_fails_naming_the_file(make_dm, tmp_path):
    good, bad = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("Some text here. And more of it.\n\n" * 400)
    bad.write_bytes(b"Fine words.\n\xff\xfe broken bytes.\n")
    dm = make_dm("gpt", corpus=TextFilesCorpus(str(tmp_path / "*.txt")), val_fraction=0.0)
    dm.setup("fit")
    steps = dm.stream.dataset.steps(0, 0, ReaderState())
    with pytest.raises(CorpusError, match="b.txt"):
        for _ in range(200):
            next(steps)


def test_the_config_check_refuses_streaming_phases(tmp_path, monkeypatch):
    point_shipped_corpora_at(tmp_path, monkeypatch)
    phases = ("model=gpt", "objective.phases=[{share: 0.5},{share: 0.5,seq_len: 64}]")
    with pytest.raises(ConfigError, match="datamodule.streaming=true reads one batch layout"):
        check_config(compose_pretrain(*phases, "datamodule.streaming=true"))


def test_streaming_refuses_phases(bpe):
    phases = [{"share": 0.5}, {"share": 0.5, "seq_len": 16}]
    phased = CausalLMObjective(seq_len=32, batch_size=4, phases=phases)
    with pytest.raises(DataSetupError, match="not objective.phases"):
        PretrainDataModule(
            ListCorpus(["a b c"]), bpe, phased, "unused", streaming=True, max_steps=10
        )


def stream_rank(rank: int, tokenizer_json: str, folder: str, results) -> None:
    """One of two gloo ranks: 7 steps, the gathered state, then 5 more steps."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2
    )
    corpus = TextFilesCorpus(f"{folder}/*.txt", doc_split="blank_line")
    objective = SETTINGS["gpt"][1]
    dm = PretrainDataModule(
        corpus,
        Tokenizer.from_str(tokenizer_json),
        objective,
        folder,
        streaming=True,
        shuffle_buffer_mb=BUFFER_MB,
        num_workers=0,
    )
    head = take(dm, 7)
    state = dm.state_dict()
    iterator = iter(dm._loader)
    tail = [next(iterator) for _ in range(5)]
    torch.distributed.destroy_process_group()
    as_numpy = [{k: v.numpy() for k, v in b.items()} for b in head + tail]
    results.put((rank, state, as_numpy))


def test_two_ranks_read_apart_and_each_resumes_from_the_gathered_state(paragraphs, bpe, tmp_path):
    for file in paragraphs.files:
        (tmp_path / Path(file).name).write_bytes(Path(file).read_bytes())
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=stream_rank, args=(r, bpe.to_str(), str(tmp_path), results))
        for r in (0, 1)
    ]
    for process in processes:
        process.start()
    outcome = {}
    for _ in processes:
        rank, state, batches = results.get(timeout=180)
        outcome[rank] = (state, batches)
    for process in processes:
        process.join(timeout=60)
    state = outcome[0][0]
    other = outcome[1][0]["streaming"]  # the state holds both ranks' readers, on both
    for reader, saved in state["streaming"]["readers_state"].items():
        got = other["readers_state"][reader]
        assert (got["cursor"], got["steps"]) == (saved["cursor"], saved["steps"])
        assert torch.equal(got["carry"], saved["carry"])
    assert sorted(state["streaming"]["readers_state"]) == [0, 1]
    first = {bytes(row) for b in outcome[0][1] for row in b["input_ids"]}
    assert first.isdisjoint(bytes(row) for b in outcome[1][1] for row in b["input_ids"])
    corpus = TextFilesCorpus(str(tmp_path / "*.txt"), doc_split="blank_line")
    for rank in (0, 1):
        dm = PretrainDataModule(
            corpus,
            bpe,
            SETTINGS["gpt"][1],
            tmp_path,
            streaming=True,
            shuffle_buffer_mb=BUFFER_MB,
            rank=rank,
            world_size=2,
        )
        dm.load_state_dict(state)
        tail = take(dm, 5)
        expected = outcome[rank][1][7:]
        assert len(tail) == len(expected) == 5
        for got, want in zip(tail, expected, strict=True):
            assert np.array_equal(got["input_ids"].numpy(), want["input_ids"])


def test_a_reader_whose_units_are_empty_for_an_epoch_goes_on(make_dm, tmp_path):
    """Three files, the middle one empty, two readers: a reader dealt only the empty file in
    some epoch passes over it instead of failing."""
    text = "Some words here. And more of them.\n\n"
    (tmp_path / "a.txt").write_text(text * 30)
    (tmp_path / "b.txt").write_text("")
    (tmp_path / "c.txt").write_text(text.replace("Some", "Other") * 30)
    corpus = TextFilesCorpus(str(tmp_path / "*.txt"))
    dm = make_dm("gpt", 2, corpus=corpus, val_fraction=0.0)
    dm.setup("fit")
    for reader in (0, 1):
        read = list(islice(dm.stream.dataset.documents(reader, Cursor()), 300))
        assert len(read) == 300 and read[-1][1].epoch >= 5


def test_a_first_file_without_documents_is_refused_naming_the_fix(make_dm, tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("Some words here. And more of them.\n\n" * 30)
    dm = make_dm("gpt", corpus=TextFilesCorpus(str(tmp_path / "*.txt")))
    with pytest.raises(DataSetupError, match="first file, and it has none.*val_fraction=0"):
        dm.check_documents()


def test_bert_text_without_sentence_pairs_fails_in_bounded_time(make_dm, tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"Line number {i} stands alone\n\n" for i in range(300)))
    dm = make_dm("bert", corpus=TextFilesCorpus(str(path)), val_fraction=0.0)
    dm.setup("fit")
    with pytest.raises(DataSetupError, match="make no BERT sentence pair"):
        dm.stream.first_step()


def test_epochs_cut_by_limit_train_batches_continue_the_stream(make_dm, paragraphs, tmp_path):
    """A Trainer that ends epochs every 7 steps (and so makes a new iterator) trains on the
    same steps as one that does not: the new iterator goes on after the consumed steps."""
    whole = fit(make_dm("gpt", 2, corpus=paragraphs), 20, tmp_path / "a")
    cut = fit(make_dm("gpt", 2, corpus=paragraphs), 20, tmp_path / "b", limit_train_batches=7)
    assert cut == whole


def test_a_parquet_file_is_shared_out_by_row_groups(make_dm, embedded, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [p for doc in embedded.documents() for p in doc.split("\n") if len(p) > 200]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": docs}), path, row_group_size=-(-len(docs) // 4))
    dm = make_dm("gpt", 2, corpus=ParquetCorpus(str(path)), val_fraction=0.0)
    dm.setup("fit")
    assert dm.stream.dataset.units == [(group, 0, 1) for group in range(4)]  # whole row groups
    read = []
    for reader in (0, 1):
        for text, after in dm.stream.dataset.documents(reader, Cursor()):
            if after.epoch > 0:
                break
            read.append(text)
    assert Counter(read) == Counter(docs)
