"""Weights a fresh run takes from counts over its training documents, before its first step.

    make pretrain experiment=bert-mini-budget word_vectors=ppmi output_bias=unigram

- `word_vectors=ppmi`: the token embeddings start from PPMI-SVD word vectors
  (pipeline/pretrain/word_vectors.py).
- `output_bias=unigram` (BERT; the `bert-fast` recipe's): the masked-LM output bias starts at
  the log frequency of each token in the training documents (their first `UNIGRAM_MAX_TOKENS`).
  The masked positions are drawn uniformly, so the best guess
  before reading any context is the unigram distribution. A model whose bias starts at zero
  predicts a uniform distribution (loss ln V, 9.0 for 8,192 tokens) and spends its first
  minutes learning which tokens are common. On WikiText-2 the validation loss (MLM + NSP) of
  BERT-mini before any step is 7.55 with it against 9.79 without, about where a `transformers`
  loop stands after 5 CPU-minutes (docs/results/time-to-loss.md). The embeddings, tied to the output
  layer, then need not carry token frequency either.

A resumed run keeps what its checkpoint holds. Only training documents are read, never
validation ones. In a multi-process run the first process counts and sends the result to the
others, so every replica starts from the same weights; FSDP (sharded weights) is refused at
config time (pipeline/pretrain/checks.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

import lightning as L
import numpy as np
import torch

from pipeline.pretrain.word_vectors import (
    check_token_ids,
    ppmi_svd_vectors,
    set_word_vectors,
    word_embedding,
)

log = logging.getLogger(__name__)

OUTPUT_BIAS_CHOICES = ("zeros", "unigram")
UNIGRAM_SMOOTHING = 0.5  # added to every token's count, so a token never seen gets a finite bias
# The unigram bias is a starting point, not a statistic to get exact: the first 10 million tokens
# (about 40 MB of English text) fix the log frequency of every token seen 1,000 times in them
# to within about 0.03, and a streamed corpus of any size is read that far, not to its end
# (before the first step of the books preset on a 2-core CPU: 14 s, where 50 million took 55 s).
# They are the first in corpus order: a corpus of parts larger than that (a mixture) counts its
# first parts only.
UNIGRAM_MAX_TOKENS = 10_000_000


def unigram_log_frequencies(
    documents: Iterable[np.ndarray],
    vocab_size: int,
    smoothing: float = UNIGRAM_SMOOTHING,
    max_tokens: int | None = UNIGRAM_MAX_TOKENS,
) -> torch.Tensor:
    """(V,) float32 log of each token's smoothed relative frequency in `documents`:
    log((count + smoothing) / (tokens + smoothing V)), counted over whole documents until
    `max_tokens` have been counted (None: all of them); later documents are not read."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    counted = 0
    for ids in documents:
        counts += np.bincount(check_token_ids(ids, vocab_size), minlength=vocab_size)
        counted += len(ids)
        if max_tokens is not None and counted >= max_tokens:
            log.info("unigram frequencies counted over the first %d training tokens", counted)
            break
    smoothed = counts + smoothing
    return torch.from_numpy(np.log(smoothed / smoothed.sum())).float()


def output_bias(model: torch.nn.Module) -> torch.nn.Parameter:
    """The bias of a model's output layer over the vocabulary: BERT's masked-LM bias. GPT's
    output layer has none (the Llama layout), so it is an error there."""
    bias = model.output_bias
    if bias is None:
        raise ValueError(
            f"{type(model).__name__} has no output bias; output_bias=unigram needs one (BERT's)"
        )
    return bias


class CorpusInit(L.Callback):
    """Sets weights from the training documents' counts before the first step of a fresh run.

    Args:
        window: word vectors counted with this window (`word_vectors.window`); None: none.
        unigram_bias: set the output bias to the unigram log frequencies (`output_bias=unigram`).
    """

    def __init__(self, window: int | None = None, unigram_bias: bool = False) -> None:
        self.window = window  # checked by the config (a ConfigError) and by `cooccurrence`
        self.unigram_bias = unigram_bias

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path is not None:  # resumed: the checkpoint holds the weights
            return
        data = trainer.datamodule

        def documents() -> Iterator[np.ndarray]:
            return data.train_document_tokens()

        started = time.perf_counter()
        computed = None
        if trainer.is_global_zero:  # one process counts; the others get its results
            computed = self._count(pl_module.model, documents)
        computed = trainer.strategy.broadcast(computed, src=0)
        model = pl_module.model
        with torch.no_grad():
            if "vectors" in computed:
                count = set_word_vectors(word_embedding(model), *computed["vectors"])
                log.info(
                    "word vectors: %d of %d token embeddings set from PPMI-SVD of the training "
                    "documents (window %d)",
                    count,
                    len(computed["vectors"][1]),
                    self.window,
                )
            if "bias" in computed:
                bias = output_bias(model)
                bias.copy_(computed["bias"].to(bias.device, bias.dtype))
                log.info("output bias: the unigram log frequencies of the training documents")
        log.info("weights counted from the corpus in %.1f s", time.perf_counter() - started)

    def _count(
        self, model: torch.nn.Module, documents: Callable[[], Iterator[np.ndarray]]
    ) -> dict[str, object]:
        vocab_size, dim = word_embedding(model).weight.shape
        computed: dict[str, object] = {}
        if self.window is not None:
            computed["vectors"] = ppmi_svd_vectors(documents(), vocab_size, dim, self.window)
        if self.unigram_bias:
            computed["bias"] = unigram_log_frequencies(documents(), vocab_size)
        return computed
