"""NSP instances against the create_pretraining_data recipe, on real text (WikiText-2 train and the
embedded corpus), with statistics over several epochs."""

import numpy as np
import pytest

from datamodules.objectives.nsp import FIELDS, IS_NEXT, IS_RANDOM, NO_PAIR, InstanceBuilder

SEQ_LEN = 128
MAX_TOKENS = SEQ_LEN - 3


def builder(store, documents=None, **kwargs) -> InstanceBuilder:
    documents = np.arange(store.num_documents) if documents is None else documents
    settings = {"seq_len": SEQ_LEN, "short_seq_prob": 0.1} | kwargs
    return InstanceBuilder(store.sentence_offsets, store.doc_sentences, documents, **settings)


def epochs(b: InstanceBuilder, n: int = 3) -> np.ndarray:
    return np.concatenate([b.build(seed) for seed in range(n)])


def columns(table: np.ndarray) -> dict[str, np.ndarray]:
    return dict(zip(FIELDS, table.T, strict=True))


def document_of(store, positions: np.ndarray) -> np.ndarray:
    return np.searchsorted(store.doc_offsets, positions, side="right") - 1


@pytest.fixture(scope="module", params=["embedded", "wikitext"])
def store(request):
    return request.getfixturevalue(
        {"embedded": "bert_store", "wikitext": "wiki_bert_store"}[request.param]
    )


@pytest.fixture(scope="module")
def instances(store) -> np.ndarray:
    # At least ~10,000 instances, so that +/- 2% is over 4 standard errors of the NSP share.
    b = builder(store)
    return epochs(b, max(3, -(-10_000 // len(b.build(0)))))


def test_labels_are_half_random(instances):
    labels = instances[:, 5]
    assert set(np.unique(labels)) == {IS_NEXT, IS_RANDOM}
    assert len(labels) >= 10_000
    assert abs((labels == IS_RANDOM).mean() - 0.5) < 0.02


def test_instances_fit_and_segments_are_non_empty(instances):
    c = columns(instances)
    a_len, b_len = c["a_end"] - c["a_start"], c["b_end"] - c["b_start"]
    assert (a_len >= 1).all() and (b_len >= 1).all()
    assert (a_len + b_len <= MAX_TOKENS).all()
    assert (a_len + b_len == MAX_TOKENS).mean() > 0.75  # most fill the target


def test_random_b_comes_from_another_document(store, instances):
    c = columns(instances[instances[:, 5] == IS_RANDOM])
    doc_a = document_of(store, c["a_start"])
    doc_b = document_of(store, c["b_start"])
    assert (doc_a != doc_b).all()
    assert (document_of(store, c["b_end"] - 1) == doc_b).all()  # B is one document's text
    assert (document_of(store, c["a_end"] - 1) == doc_a).all()


def test_actual_b_continues_a_in_the_source(store, instances):
    c = columns(instances[instances[:, 5] == IS_NEXT])
    # A ends (before truncation) at a sentence boundary, and B starts right there: the only
    # tokens between them in the text are the ones truncation removed.
    assert np.isin(c["cut"], store.sentence_offsets).all()
    assert ((c["a_start"] < c["a_end"]) & (c["a_end"] <= c["cut"])).all()
    assert ((c["cut"] <= c["b_start"]) & (c["b_start"] < c["b_end"])).all()
    assert (document_of(store, c["a_start"]) == document_of(store, c["b_end"] - 1)).all()


def test_short_sequence_share_shows_in_the_lengths(store):
    def shorter_than_max(p: float) -> float:
        c = columns(epochs(builder(store, short_seq_prob=p)))
        lengths = c["a_end"] - c["a_start"] + c["b_end"] - c["b_start"]
        return (lengths < MAX_TOKENS).mean()

    without, recipe, always = shorter_than_max(0.0), shorter_than_max(0.1), shorter_than_max(1.0)
    # A random target in [2, 125] ends below the maximum about half the time, so 10% short
    # targets add roughly 5 points of short instances.
    assert 0.03 < recipe - without < 0.10
    assert always > 0.4


def test_epochs_differ_and_repeat_exactly(store):
    b = builder(store)
    assert np.array_equal(b.build(7), b.build(7))
    assert not np.array_equal(b.build(7), b.build(8))


def test_pairs_stay_inside_the_split(store):
    rng = np.random.default_rng(0)
    split = np.sort(rng.choice(store.num_documents, store.num_documents // 2, replace=False))
    c = columns(builder(store, split).build(0))
    for column in ("a_start", "b_start"):
        assert np.isin(document_of(store, c[column]), split).all()


def test_without_nsp_instances_are_single_segments(store):
    c = columns(builder(store, next_sentence_prediction=False).build(0))
    assert (c["label"] == NO_PAIR).all() and (c["b_start"] == c["b_end"]).all()
    lengths = c["a_end"] - c["a_start"]
    assert (lengths >= 1).all() and (lengths <= SEQ_LEN - 2).all()
    assert (lengths == SEQ_LEN - 2).mean() > 0.75


def test_nsp_needs_two_documents(bert_store):
    with pytest.raises(ValueError, match="at least 2 documents"):
        builder(bert_store, np.array([3]))
