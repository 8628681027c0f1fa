"""Word vectors counted from the corpus (`word_vectors=ppmi`, pipeline/pretrain/word_vectors.py): the
counts and PPMI against hand computations, vectors that put co-occurring words together, and a
run whose embeddings start from them (a fresh run only)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from pipeline.pretrain.checks import check_config
from pipeline.pretrain.corpus_init import CorpusInit
from pipeline.pretrain.word_vectors import (
    cooccurrence,
    ppmi,
    ppmi_svd_vectors,
    set_word_vectors,
    word_embedding,
)
from pipeline.run.errors import ConfigError
from tests.conftest import compose_pretrain
from tests.pipeline.test_modules import tiny_run


def test_cooccurrence_counts_pairs_within_the_window_and_each_document():
    docs = [np.array([1, 2, 3, 1]), np.array([4, 1])]
    counts = cooccurrence(docs, vocab_size=5, window=2).to_dense()
    expected = torch.zeros(5, 5, dtype=torch.float64)
    # document 1, offsets 1 and 2: (1,2) (2,3) (3,1), (1,3) (2,1); document 2: (4,1)
    for a, b in [(1, 2), (2, 3), (3, 1), (1, 3), (2, 1), (4, 1)]:
        expected[a, b] += 1
        expected[b, a] += 1
    assert torch.equal(counts, expected)
    assert counts[3, 4] == 0  # never across documents
    with pytest.raises(ValueError, match="window=0"):
        cooccurrence(docs, 5, 0)


def test_counts_do_not_depend_on_how_documents_are_chunked():
    docs = _two_topic_documents()
    whole = cooccurrence(docs, vocab_size=20, window=3).to_dense()
    chunked = cooccurrence(docs, vocab_size=20, window=3, chunk_tokens=50).to_dense()
    assert torch.equal(whole, chunked) and whole.sum() > 0
    with pytest.raises(ValueError, match=r"token ids outside \[0, 10\)"):
        cooccurrence(docs, vocab_size=10, window=3)


def test_ppmi_is_the_positive_part_of_smoothed_pmi():
    dense = torch.tensor([[0, 4, 1], [4, 0, 2], [1, 2, 6]], dtype=torch.float64)
    got = ppmi(dense.to_sparse(), context_power=0.75).to_dense()
    total = dense.sum()
    word = dense.sum(1)
    context = word**0.75 / (word**0.75).sum()
    for i in range(3):
        for j in range(3):
            if dense[i, j] == 0:
                assert got[i, j] == 0
                continue
            pmi = math.log(dense[i, j] / total) - math.log(word[i] / total * context[j])
            assert got[i, j] == pytest.approx(max(pmi, 0.0))
    assert (got > 0).any() and (got == 0).sum() > 3  # some negative PMI was cut to 0


def _two_topic_documents(seed: int = 0) -> list[np.ndarray]:
    """Tokens 1-8 only ever occur with each other, as do tokens 9-16; token 0 never occurs."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 9, 40) for _ in range(60)] + [
        rng.integers(9, 17, 40) for _ in range(60)
    ]


def test_vectors_put_words_of_the_same_contexts_together_deterministically():
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    vectors, seen = ppmi_svd_vectors(_two_topic_documents(), vocab_size=20, dim=8, window=3)
    assert torch.equal(torch.rand(3), expected_next)  # the training RNG is left alone
    assert seen.tolist() == [False] + [True] * 16 + [False] * 3
    assert vectors[~seen].abs().sum() == 0
    unit = vectors[seen] / vectors[seen].norm(dim=1, keepdim=True)
    cosine = unit @ unit.T
    within = torch.cat([cosine[:8, :8].flatten(), cosine[8:, 8:].flatten()]).mean()
    across = cosine[:8, 8:].mean()
    assert within > 0.8 and across.abs() < 0.2
    again, _ = ppmi_svd_vectors(_two_topic_documents(), vocab_size=20, dim=8, window=3)
    assert torch.equal(vectors, again)


def test_set_word_vectors_keeps_the_scale_and_the_rows_never_seen():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(6, 4)
    before = embedding.weight.detach().clone()
    vectors = torch.randn(6, 4) * 100
    seen = torch.tensor([False, True, True, False, True, False])
    assert set_word_vectors(embedding, vectors, seen) == 3
    after = embedding.weight.detach()
    assert torch.equal(after[~seen], before[~seen])
    norms = after[seen].norm(dim=1)
    assert torch.allclose(norms, before[seen].norm(dim=1).mean().expand(3))
    direction = torch.nn.functional.cosine_similarity(after[seen], vectors[seen])
    assert torch.allclose(direction, torch.ones(3))
    with pytest.raises(ValueError, match="do not fit the embedding"):
        set_word_vectors(embedding, torch.zeros(5, 4), seen[:5])


class _Snapshot(L.Callback):
    """The word embedding as the first step receives it."""

    weight: torch.Tensor | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.weight = word_embedding(pl_module.model).weight.detach().clone()


@pytest.mark.parametrize("model", ["bert-tiny", "gpt-tiny"])
def test_a_fresh_run_starts_from_the_training_documents_vectors(model, tmp_path, small_docs):
    module, datamodule, trainer = tiny_run(
        tmp_path, small_docs, f"model={model}", "trainer.max_steps=1", "word_vectors=ppmi"
    )
    random_init = word_embedding(module.model).weight.detach().clone()
    snapshot = _Snapshot()
    trainer.callbacks.append(snapshot)
    trainer.fit(module, datamodule=datamodule)
    documents = [datamodule.store.document(int(i)) for i in datamodule.train_documents]
    vectors, seen = ppmi_svd_vectors(documents, *random_init.shape, window=5)
    expected = torch.nn.Embedding(*random_init.shape)
    expected.weight.data.copy_(random_init)
    set_word_vectors(expected, vectors, seen)
    assert seen.sum() > 100
    assert torch.allclose(snapshot.weight, expected.weight, atol=1e-6)
    assert torch.equal(snapshot.weight[~seen], random_init[~seen])


def test_a_resumed_run_keeps_its_checkpoint_embeddings():
    embedding = torch.nn.Embedding(10, 4)
    before = embedding.weight.detach().clone()
    module = SimpleNamespace(model=SimpleNamespace(embeddings=SimpleNamespace(word=embedding)))
    resumed = SimpleNamespace(ckpt_path="last.ckpt", datamodule=None)
    CorpusInit(window=5).on_fit_start(resumed, module)  # would fail reading a None datamodule
    assert torch.equal(embedding.weight, before)


def test_bad_word_vector_settings_are_config_errors():
    with pytest.raises(ConfigError, match=r"word_vectors.window=0"):
        check_config(compose_pretrain("word_vectors=ppmi", "word_vectors.window=0"))
    with pytest.raises(ConfigError, match="not supported with trainer=fsdp"):
        check_config(compose_pretrain("recipe=bert-reference", "word_vectors=ppmi", "trainer=fsdp"))
