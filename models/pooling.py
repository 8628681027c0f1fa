"""Learned attention pooling of a document's chunk states into one document vector.

Shapes: N chunks (over all documents of a batch), D width, A attention width, M documents.

For sliding-window classification of long texts: each chunk `[CLS] chunk [SEP]` goes through
the encoder, and its [CLS] (or pooled) state h_n in R^D is scored

    score_n = w . tanh(W h_n + b)

(additive attention with a learned query, as in hierarchical attention networks). The scores are
softmaxed among the chunks of the same document only, and the document vector is the weighted
sum of its chunk states; a classifier then runs on (M, D). Documents may have any number of
chunks; `doc_index` says which document each chunk belongs to.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

__all__ = ["ChunkAttentionPooling", "aggregate_chunk_logits", "segment_softmax"]


def _check_doc_index(
    values: torch.Tensor, doc_index_N: torch.Tensor, num_docs: int, name: str
) -> torch.Tensor:
    """`doc_index_N` as int64 after checking it fits `values` (N, X) and gives every one of the
    `num_docs` documents at least one chunk; `name` names `values` in the error."""
    if values.ndim != 2 or doc_index_N.shape != values.shape[:1]:
        raise ValueError(
            f"expected {name} and doc_index (N,), got {tuple(values.shape)} and "
            f"{tuple(doc_index_N.shape)}"
        )
    index_N = doc_index_N.long()
    if index_N.numel() and (index_N.min() < 0 or index_N.max() >= num_docs):
        raise ValueError(f"doc_index values must be in [0, num_docs={num_docs})")
    if bool((torch.bincount(index_N, minlength=num_docs) == 0).any()):
        raise ValueError(
            "every document needs at least one chunk; some index in [0, num_docs) has none"
        )
    return index_N


def segment_softmax(
    scores_N: torch.Tensor, doc_index_N: torch.Tensor, num_docs: int
) -> torch.Tensor:
    """Softmax of `scores_N` within each group of equal `doc_index_N`. (N,) -> (N,).

    The per-document maximum is subtracted first, so large scores do not overflow.
    """
    index_N = doc_index_N.long()
    max_M = scores_N.new_full((num_docs,), float("-inf")).scatter_reduce(
        0, index_N, scores_N, reduce="amax", include_self=True
    )
    exp_N = (scores_N - max_M[index_N].detach()).exp()
    sum_M = scores_N.new_zeros(num_docs).index_add(0, index_N, exp_N)
    return exp_N / sum_M[index_N]


class ChunkAttentionPooling(nn.Module):
    """Attention-weighted average of chunk states per document.

    Args:
        d_model: D, the width of the chunk states.
        d_attn: A, width of the scoring layer (default D).
        init_std: std of the normal initialization (see `init_weights`).
    """

    def __init__(self, d_model: int, d_attn: int | None = None, *, init_std: float = 0.02) -> None:
        super().__init__()
        if d_model < 1:
            raise ValueError(f"d_model must be >= 1, got {d_model}")
        d_attn = d_model if d_attn is None else d_attn
        if d_attn < 1:
            raise ValueError(f"d_attn must be >= 1, got {d_attn}")
        self.proj = nn.Linear(d_model, d_attn)  # W, b
        self.query = nn.Linear(d_attn, 1, bias=False)  # w
        self.init_std = init_std
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """W and w ~ Normal(0, init_std), b = 0: the initial scores are near 0, so pooling starts
        close to the mean of the chunk states (the "mean" aggregation) and learns from there."""
        nn.init.normal_(self.proj.weight, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.proj.bias)
        nn.init.normal_(self.query.weight, mean=0.0, std=self.init_std)

    def weights(self, h_ND: torch.Tensor, doc_index_N: torch.Tensor, num_docs: int) -> torch.Tensor:
        """Attention weight of each chunk within its document. Returns (N,), summing to 1 per doc."""
        scores_N = self.query(torch.tanh(self.proj(h_ND))).squeeze(-1)
        return segment_softmax(scores_N, doc_index_N, num_docs)

    def forward(self, h_ND: torch.Tensor, doc_index_N: torch.Tensor, num_docs: int) -> torch.Tensor:
        """Pool chunk states into document states.

        Args:
            h_ND: (N, D) [CLS] states of the chunks.
            doc_index_N: (N,) document of each chunk, in [0, num_docs), any order.
            num_docs: M; every document must have at least one chunk.

        Returns:
            (M, D) document states.

        Raises:
            ValueError: mismatched shapes, an index out of range, or a document without chunks.
        """
        index_N = _check_doc_index(h_ND, doc_index_N, num_docs, "h (N, D)")
        weights_N = self.weights(h_ND, doc_index_N, num_docs)
        out_MD = h_ND.new_zeros(num_docs, h_ND.shape[1])
        return out_MD.index_add(0, index_N, weights_N.unsqueeze(-1) * h_ND)


def aggregate_chunk_logits(
    logits_NC: torch.Tensor,
    doc_index_N: torch.Tensor,
    num_docs: int,
    how: Literal["mean", "max"] = "mean",
) -> torch.Tensor:
    """One row of scores per document from the scores of its chunks.

    Args:
        logits_NC: chunk logits (N, C), or regression outputs (N, 1).
        doc_index_N: (N,) integer document of each chunk, in [0, num_docs); any order.
        num_docs: M. Every document must have at least one chunk.
        how: "mean" averages the logits of a document's chunks; "max" takes the per-class
            maximum (a class wins if any chunk is confident about it).

    Returns:
        (M, C) document logits, differentiable with respect to `logits_NC`.

    Raises:
        ValueError: mismatched shapes, an index out of range, a document without chunks, or an
            unknown `how`.
    """
    reduce = {"mean": "mean", "max": "amax"}.get(how)
    if reduce is None:
        raise ValueError(f"aggregation must be 'mean' or 'max', got {how!r}")
    doc_index_N = _check_doc_index(logits_NC, doc_index_N, num_docs, "logits (N, C)")
    out_MC = logits_NC.new_zeros(num_docs, logits_NC.shape[1])
    index_NC = doc_index_N.unsqueeze(1).expand_as(logits_NC)
    return out_MC.scatter_reduce(0, index_NC, logits_NC, reduce=reduce, include_self=False)
