"""Word vectors counted from the pretraining corpus, as the embedding matrix's starting point.

    make pretrain experiment=bert-mini-budget word_vectors=ppmi

A model pretrained for minutes on a CPU learns little about which words are alike: BERT mini's
word embeddings after an hour of masked-LM training on WikiText-2 are, for a linear probe of
sentiment, barely better than random ones (docs/results/quick-suite.md, History). Counting
does in seconds what gradient steps do slowly: before the first step (pipeline/pretrain/corpus_init.py),
the run counts how often each pair of tokens occurs within `window` positions of each other in
its training documents, turns the counts into positive pointwise mutual information with
context-distribution smoothing (PPMI, Levy, Goldberg & Dagan 2015, "Improving Distributional
Similarity with Lessons Learned from Word Embeddings"), and factors that sparse (V, V) matrix by
a truncated SVD. Row i of U sqrt(S) (D columns) becomes token i's embedding, scaled to the
average norm of the rows it replaces, so the optimizer sees the same scale as from a random
start. Tokens that never occur (special tokens, rare subwords) keep their random rows. Training
then goes on as usual: every weight still trains.

Only the run's training documents are read (never its validation documents), the result depends
only on them and `window` (the SVD's random start comes from its own seeded generator, and the
training RNG is left as it was), and a resumed run takes its embeddings from its checkpoint
instead. In a multi-process run the first process computes the vectors and sends them to the
others, so every replica starts from the same weights. The matrix must be whole on each
process: sharded parameters (FSDP) are refused at config time.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
import torch

from models.heads import backbone_of

SVD_SEED = 0


def check_token_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """`ids` as int64, after checking that every one is a token of the vocabulary."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token ids outside [0, {vocab_size}) in the documents: the token store does not "
            "belong to this tokenizer; delete the run's token-store cache and run again"
        )
    return ids


def cooccurrence(
    documents: Iterable[np.ndarray], vocab_size: int, window: int, chunk_tokens: int = 1 << 23
) -> torch.Tensor:
    """(V, V) sparse, coalesced float64 counts of token pairs at most `window` positions apart
    within a document, counted in both directions (symmetric). Documents are read in chunks of
    about `chunk_tokens` tokens, each counted in a few vectorized passes (one per offset) and
    merged into the running counts, so memory goes with the distinct pairs, not the corpus."""
    if window < 1:
        raise ValueError(f"word_vectors.window={window}: use 1 or more")
    keys: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64)]  # the running counts ...
    counts: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64)]  # ... then this chunk's

    def count(chunk: list[np.ndarray]) -> None:
        ids_N = torch.as_tensor(check_token_ids(np.concatenate(chunk), vocab_size))
        doc_N = torch.repeat_interleave(
            torch.arange(len(chunk)), torch.tensor([len(d) for d in chunk])
        )
        for offset in range(1, window + 1):
            same_doc = doc_N[:-offset] == doc_N[offset:]
            left, right = ids_N[:-offset][same_doc], ids_N[offset:][same_doc]
            if not len(left):
                break
            pair_keys = torch.cat([left * vocab_size + right, right * vocab_size + left])
            unique, number = torch.unique(pair_keys, return_counts=True)
            keys.append(unique)
            counts.append(number)
        merged, where = torch.unique(torch.cat(keys), return_inverse=True)
        total = torch.zeros(len(merged), dtype=torch.int64).index_add_(0, where, torch.cat(counts))
        keys[:], counts[:] = [merged], [total]

    chunk: list[np.ndarray] = []
    size = 0
    for ids in documents:
        chunk.append(np.asarray(ids))
        size += len(ids)
        if size >= chunk_tokens:
            count(chunk)
            chunk, size = [], 0
    if chunk:
        count(chunk)
    [key_K], [count_K] = keys, counts
    index_2K = torch.stack([key_K // vocab_size, key_K % vocab_size])
    return torch.sparse_coo_tensor(
        index_2K, count_K.double(), (vocab_size, vocab_size), check_invariants=False
    ).coalesce()


def ppmi(counts: torch.Tensor, context_power: float = 0.75) -> torch.Tensor:
    """Positive PMI of sparse co-occurrence `counts` (V, V), with the context distribution
    raised to `context_power` (0.75 lowers rare contexts' PMI, as word2vec's negative sampling
    does): max(0, log(P(w, c) / (P(w) P_a(c)))). Sparse, same pattern, zeros dropped."""
    index_2K, count_K = counts.indices(), counts.values()
    word_V = torch.sparse.sum(counts, dim=1).to_dense()
    total = word_V.sum()
    context_V = word_V.pow(context_power)
    context_V = context_V / context_V.sum()
    pmi_K = torch.log(count_K / total) - torch.log(
        word_V[index_2K[0]] / total * context_V[index_2K[1]]
    )
    keep_K = pmi_K > 0
    return torch.sparse_coo_tensor(
        index_2K[:, keep_K], pmi_K[keep_K], counts.shape, check_invariants=False
    ).coalesce()


def ppmi_svd_vectors(
    documents: Iterable[np.ndarray], vocab_size: int, dim: int, window: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """(V, dim) float32 word vectors U sqrt(S) of the truncated SVD of the PPMI matrix of
    `documents`' token co-occurrences, and the (V,) bool mask of the tokens that got a vector
    (those that occur with a positive PMI somewhere; the other rows are zero). Deterministic: the SVD's random start is seeded."""
    matrix = ppmi(cooccurrence(documents, vocab_size, window))
    seen_V = torch.sparse.sum(matrix, dim=1).to_dense() > 0
    rank = min(dim, vocab_size)
    u_VR, s_R = randomized_svd(matrix, rank)
    vectors = torch.zeros(vocab_size, dim, dtype=torch.float32)
    vectors[:, :rank] = (u_VR * s_R.clamp_min(0).sqrt()).float()
    seen_V &= vectors.norm(dim=1) > 0
    vectors[~seen_V] = 0.0  # the SVD leaves rounding noise in the rows of unseen tokens
    return vectors, seen_V


def randomized_svd(
    matrix: torch.Tensor, rank: int, oversample: int = 10, power_iterations: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rank` leading left singular vectors (V, rank) and values (rank,) of a sparse (V, V)
    matrix, in float32, by a randomized range finder with power iterations (Halko, Martinsson &
    Tropp 2011). The matrix stays sparse (CSR), so memory goes with its non-zeros rather than
    V^2, and the Gaussian start is drawn from its own seeded generator: the result is
    deterministic and the global random state is not touched."""
    size = matrix.shape[1]
    width = min(rank + oversample, size)
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta"
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support")
        forward = matrix.float().to_sparse_csr()
        backward = matrix.t().coalesce().float().to_sparse_csr()
    start = torch.randn(size, width, generator=torch.Generator().manual_seed(SVD_SEED))
    basis, _ = torch.linalg.qr(forward @ start)
    for _ in range(power_iterations):  # sharpens the spectrum's decay: (A A^T)^q A
        back, _ = torch.linalg.qr(backward @ basis)
        basis, _ = torch.linalg.qr(forward @ back)
    small = (backward @ basis).t()  # (width, V) = basis^T A
    u_small, values, _ = torch.linalg.svd(small, full_matrices=False)
    return (basis @ u_small)[:, :rank], values[:rank]


def word_embedding(model: torch.nn.Module) -> torch.nn.Embedding:
    """The token embedding of any family's model (BERT's MLM decoder, and GPT's output layer
    unless `tie_embeddings=false`, share it, so they start from the same vectors)."""
    return backbone_of(model).word_embeddings


@torch.no_grad()
def set_word_vectors(embedding: torch.nn.Embedding, vectors: torch.Tensor, seen: torch.Tensor):
    """Overwrite the rows of `seen` tokens with `vectors`, each scaled to the mean norm of the
    rows being replaced; the other rows stay as they are. Returns the number of rows set."""
    weight = embedding.weight
    if vectors.shape != weight.shape:
        raise ValueError(
            f"word vectors {tuple(vectors.shape)} do not fit the embedding {tuple(weight.shape)}"
        )
    rows = seen.nonzero().squeeze(1).to(weight.device)
    if not len(rows):
        return 0
    scale = weight[rows].float().norm(dim=1).mean()
    chosen = vectors.to(weight.device)[rows]
    weight[rows] = (chosen / chosen.norm(dim=1, keepdim=True) * scale).to(weight.dtype)
    return len(rows)
