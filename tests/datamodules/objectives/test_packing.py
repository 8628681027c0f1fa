"""GPT packing on real text (WikiText-2 train and the embedded corpus)."""

import numpy as np
import pytest
import torch

from datamodules.objectives.batches import TRAIN, VAL
from datamodules.objectives.gpt_batches import GPTBatches
from datamodules.objectives.objective import CausalLMObjective
from datamodules.objectives.packing import PackedStream
from models.gpt import positions_from_docs
from tests.conftest import ListCorpus
from tests.datamodules.helpers import all_documents, build
from tokenizer.token_bytes import token_byte_counts

SEQ_LEN = 128


def gpt_batches(store, documents=None, shuffle=False, **objective) -> GPTBatches:
    documents = all_documents(store) if documents is None else documents
    settings = {"seq_len": SEQ_LEN, "batch_size": 16} | objective
    return GPTBatches(
        store,
        documents,
        CausalLMObjective(**settings),
        rank=0,
        world_size=1,
        seed=3,
        split=TRAIN,
        shuffle=shuffle,
    )


def epoch(dataset: GPTBatches, number: int = 0) -> list[dict[str, np.ndarray]]:
    """All batches of one epoch, in order."""
    return [dataset[(number, i)] for i in range(len(dataset))]


@pytest.fixture(scope="module", params=["embedded", "wikitext"])
def store(request):
    return request.getfixturevalue(
        {"embedded": "gpt_store", "wikitext": "wiki_gpt_store"}[request.param]
    )


def test_windows_reproduce_the_stream(store):
    batches = epoch(gpt_batches(store))
    inputs = np.concatenate([b["input_ids"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])
    tokens = np.asarray(store.tokens, dtype=np.int64)
    count = len(inputs)
    assert inputs.shape[1] == SEQ_LEN and count == (len(tokens) - 1) // SEQ_LEN
    assert np.array_equal(inputs.reshape(-1), tokens[: count * SEQ_LEN])
    assert np.array_equal(targets[:, :-1], inputs[:, 1:])  # shifted by one
    assert np.array_equal(targets[:-1, -1], inputs[1:, 0])  # across windows too
    assert targets[-1, -1] == tokens[count * SEQ_LEN]
    assert len(tokens) - (count * SEQ_LEN + 1) < SEQ_LEN  # only the tail is dropped


def test_document_ids_follow_eos(store):
    eos = store.eos_id
    for b in epoch(gpt_batches(store, document_masking=True))[:20]:
        inputs, doc_ids, positions = b["input_ids"], b["doc_ids"], b["position_ids"]
        assert (doc_ids[:, 0] == 0).all()
        changes = np.diff(doc_ids, axis=1)
        assert set(np.unique(changes)) <= {0, 1}
        assert np.array_equal(changes == 1, inputs[:, 1:] == eos)  # a new id exactly at EOS
        restart = np.zeros_like(inputs, dtype=bool)
        restart[:, 0] = True
        restart[:, 1:] = changes == 1
        assert np.array_equal(positions == 0, restart)
        expected = positions_from_docs(torch.from_numpy(doc_ids)).numpy()
        assert np.array_equal(positions, expected)  # what the model would derive
    assert "doc_ids" not in gpt_batches(store)[(0, 0)]


def test_held_out_documents_leave_the_stream(store):
    rng = np.random.default_rng(1)
    kept = np.sort(rng.choice(store.num_documents, store.num_documents * 3 // 4, replace=False))
    stream = PackedStream(store.tokens, store.doc_offsets, kept)
    expected = np.concatenate([store.document(int(d)) for d in kept]).astype(np.int64)
    assert len(stream) == len(expected)
    assert np.array_equal(stream.read(0, len(expected)), expected)
    start = len(expected) // 3
    assert np.array_equal(stream.read(start, 5000), expected[start : start + 5000])


def test_window_order_is_shuffled_per_epoch(store):
    dataset = gpt_batches(store, shuffle=True)
    first, second = dataset.order(0), dataset.order(1)
    assert sorted(first) == sorted(second) == list(range(dataset.plan.num_items))
    assert not np.array_equal(first, second)
    window = dataset.stream.windows(first[:1], SEQ_LEN)[0]
    batch = dataset[(0, 0)]
    assert np.array_equal(batch["input_ids"][0], window[:-1])


def test_too_little_text_for_one_window(bpe, tmp_path):
    store = build(ListCorpus(["tiny", "docs"]), bpe, CausalLMObjective(), tmp_path)
    with pytest.raises(
        ValueError, match=r"training documents hold \d+ tokens, fewer than one window"
    ):
        gpt_batches(store)


def test_validation_windows_count_the_bytes_of_text_they_predict(gpt_store, bpe):
    """`target_bytes` of consecutive windows = the UTF-8 bytes of their targets, decoded."""
    dataset = GPTBatches(
        gpt_store,
        all_documents(gpt_store),
        CausalLMObjective(seq_len=SEQ_LEN, batch_size=4),
        token_bytes=token_byte_counts(bpe),
        rank=0,
        world_size=1,
        seed=3,
        split=VAL,
        shuffle=False,
    )
    for index in range(3):
        batch = dataset[(0, index)]
        targets = batch["targets"].reshape(-1).tolist()  # the windows are consecutive
        text = bpe.decode(targets, skip_special_tokens=True)
        assert int(batch["target_bytes"].sum()) == len(text.encode("utf-8"))
    assert "target_bytes" not in gpt_batches(gpt_store)[(0, 0)]  # training batches: none
