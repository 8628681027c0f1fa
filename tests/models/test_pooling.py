"""Attention pooling over the chunk states of each document."""

from __future__ import annotations

import pytest
import torch

from models.pooling import ChunkAttentionPooling, aggregate_chunk_logits, segment_softmax

D = 16
DOC_INDEX = torch.tensor([1, 0, 2, 1, 1, 3, 0])  # unsorted; docs have 2, 3, 1 and 1 chunks


def _pool(seed: int = 0) -> ChunkAttentionPooling:
    torch.manual_seed(seed)
    pool = ChunkAttentionPooling(D)
    # larger weights than the init so the attention is far from uniform and tests can tell
    with torch.no_grad():
        for p in pool.parameters():
            p.normal_(0, 1.0)
    return pool


def _states(n: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def test_output_shape_and_reference_loop() -> None:
    pool, h = _pool(), _states()
    out = pool(h, DOC_INDEX, 4)
    assert out.shape == (4, D)
    # reference: an explicit softmax over each document's chunks
    scores = pool.query(torch.tanh(pool.proj(h))).squeeze(-1)
    for d in range(4):
        mine = d == DOC_INDEX
        w = torch.softmax(scores[mine], dim=0)
        torch.testing.assert_close(out[d], (w.unsqueeze(-1) * h[mine]).sum(0))


def test_weights_sum_to_one_per_document_and_are_not_uniform() -> None:
    pool, h = _pool(), _states()
    w = pool.weights(h, DOC_INDEX, 4)
    assert w.shape == (7,) and bool((w > 0).all())
    sums = torch.zeros(4).index_add(0, DOC_INDEX, w)
    torch.testing.assert_close(sums, torch.ones(4))
    assert not torch.allclose(w[DOC_INDEX == 1], torch.full((3,), 1 / 3), atol=1e-3)


def test_permutation_invariance_within_and_across_documents() -> None:
    pool, h = _pool(), _states()
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(pool(h[perm], DOC_INDEX[perm], 4), pool(h, DOC_INDEX, 4))


def test_one_chunk_document_returns_its_own_state() -> None:
    pool, h = _pool(), _states()
    out = pool(h, DOC_INDEX, 4)
    torch.testing.assert_close(out[2], h[2])
    torch.testing.assert_close(out[3], h[5])


def test_initial_pooling_is_close_to_the_mean() -> None:
    torch.manual_seed(0)
    pool, h = ChunkAttentionPooling(D), _states()
    counts = torch.bincount(DOC_INDEX, minlength=4).float()
    torch.testing.assert_close(
        pool.weights(h, DOC_INDEX, 4), 1 / counts[DOC_INDEX], atol=1e-2, rtol=0
    )
    assert not pool.proj.bias.detach().any()


def test_gradients_flow_to_states_and_parameters() -> None:
    pool = _pool()
    h = _states().requires_grad_(True)
    pool(h, DOC_INDEX, 4).pow(2).sum().backward()
    assert h.grad is not None and bool((h.grad.abs().sum(-1) > 0).all())
    for name, p in pool.named_parameters():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name


def test_segment_softmax_is_stable_for_large_scores() -> None:
    scores = torch.tensor([1000.0, 1001.0, -1000.0, 5.0])
    w = segment_softmax(scores, torch.tensor([0, 0, 1, 1]), 2)
    assert bool(torch.isfinite(w).all())
    torch.testing.assert_close(w[:2], torch.softmax(scores[:2], 0))
    torch.testing.assert_close(w[2:], torch.softmax(scores[2:], 0))


@pytest.mark.parametrize(
    ("doc_index", "num_docs", "match"),
    [
        ([0, 0, 2], 3, "at least one chunk"),
        ([0, 1, 3], 3, r"\[0, num_docs=3\)"),
        ([0, -1, 2], 3, r"\[0, num_docs=3\)"),
        ([0, 1], 3, "expected h"),
    ],
)
def test_bad_input(doc_index: list[int], num_docs: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ChunkAttentionPooling(4)(torch.zeros(3, 4), torch.tensor(doc_index), num_docs)


# Mean / max aggregation of chunk logits


def _hand_aggregate(logits: torch.Tensor, doc_index: torch.Tensor, num_docs: int, how: str):
    rows = []
    for d in range(num_docs):
        mine = logits[doc_index == d]
        rows.append(mine.mean(0) if how == "mean" else mine.max(0).values)
    return torch.stack(rows)


@pytest.mark.parametrize("how", ["mean", "max"])
def test_aggregation_equals_hand_loop(how: str) -> None:
    gen = torch.Generator().manual_seed(0)
    doc_index = torch.tensor([2, 0, 0, 1, 2, 2, 3, 0])  # unsorted, 1 to 3 chunks per document
    logits = torch.randn(8, 3, generator=gen)
    out = aggregate_chunk_logits(logits, doc_index, 4, how)
    assert out.shape == (4, 3)
    torch.testing.assert_close(out, _hand_aggregate(logits, doc_index, 4, how))


def test_max_and_mean_differ() -> None:
    logits = torch.tensor([[0.0, 4.0], [1.0, -4.0], [2.0, -2.0]])
    doc_index = torch.tensor([0, 0, 0])
    mean = aggregate_chunk_logits(logits, doc_index, 1, "mean")
    top = aggregate_chunk_logits(logits, doc_index, 1, "max")
    torch.testing.assert_close(mean, torch.tensor([[1.0, -2 / 3]]))
    torch.testing.assert_close(top, torch.tensor([[2.0, 4.0]]))
    assert mean.argmax(-1).item() == 0 and top.argmax(-1).item() == 1


def test_aggregation_is_differentiable() -> None:
    logits = torch.randn(5, 2, requires_grad=True)
    out = aggregate_chunk_logits(logits, torch.tensor([0, 0, 1, 1, 1]), 2, "mean")
    out.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[0.5] * 2] * 2 + [[1 / 3] * 2] * 3))


@pytest.mark.parametrize(
    ("doc_index", "num_docs", "how", "match"),
    [
        ([0, 0, 2], 3, "mean", "at least one chunk"),
        ([0, 1, 3], 3, "mean", r"\[0, num_docs=3\)"),
        ([0, 1, 2], 3, "median", "'mean' or 'max'"),
        ([0, 1], 3, "mean", "expected logits"),
    ],
)
def test_aggregation_bad_input(doc_index: list[int], num_docs: int, how: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        aggregate_chunk_logits(torch.zeros(3, 2), torch.tensor(doc_index), num_docs, how)
