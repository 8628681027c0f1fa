"""The log-probability a model gives a whole sentence, the score minimal-pair evaluations
(BLiMP, pipeline/infer/blimp.py) compare: a model prefers the sentence it scores higher.

- A causal model (a family that does "score", the GPT): log p(sentence | separator), summed over
  the sentence's tokens, the sentence read as the start of a document (after the end-of-text
  token that separates documents in training; [SEP] for a WordPiece tokenizer).
- A masked model (a family that does "fill-mask", the BERT): the pseudo-log-likelihood (Salazar
  et al. 2020), the sum over the sentence's tokens of log p(token | the sentence with it masked).
  `pll="word_l2r"`, the default, is the variant of Kauf & Ivanova (2023): a token is scored with
  the rest of its word's pieces to its right masked too. Plain PLL (`pll="token"`) lets the
  later pieces of a word give the earlier ones away ("obs" is near certain once "##erv ##ation"
  is visible), so a sentence with long rare words scores too high for what the model knows;
  they found the word-level variant the better-behaved score and no worse on BLiMP.

Autocast is off while scoring, also inside a bf16 autocast region (a probe in a bf16-mixed run),
so a model with fp32 weights (every precision but bf16-true, and FSDP's bf16 gathering) scores in
fp32: the two sentences of a minimal pair differ in a word or two, their scores are close, and
bf16's rounding decides near-ties. On a GPU, bf16 autocast turned answers that fp32 gives on the
CPU (docs/results/blimp.md, "On a GPU").

Sentences are batched: a causal model reads `batch_size` sentences at a time (padded on the
right, which a causal model never looks at); a masked model reads `batch_size` masked copies at
a time, each scoring one token, the copies of sentences of one length side by side (no padding,
no attention mask). A copy is read at its mask only, so the model's last block runs its query,
feed-forward and output layer at that one token (`mlm_logits_at`): the rest of the last block's
work would be thrown away. Nothing else can be shared between the copies of a sentence: from the
first block's attention on, every position sees the mask. The scores are those of a whole
forward pass per copy up to fp32 rounding (tests/pipeline/test_sentence_scoring.py). Sentences of
the same tokens are scored once, so that they get the same score to the last bit: a pair whose
two sentences are the same (BLiMP has a few) ties, whatever batches they would have fallen in.
On a CPU, two batches run side by side, each on half the torch threads (`SentenceScorer._scored`).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from pipeline.checkpoint.load import Pretrained
from pipeline.run.errors import ConfigError
from pipeline.run.families import family_named
from tokenizer import special_ids

PLL_METHODS = ("word_l2r", "token")
SIDE_BY_SIDE = 2  # batches scored at once on a CPU, each on its share of the torch threads
Batch = TypeVar("Batch")
Scored = TypeVar("Scored")


@dataclass(frozen=True)
class SentenceScorer:
    """Scores sentences with a model on `device` (it must already be there).

    Args:
        pretrained: the model and its tokenizer.
        device: where the model is.
        batch_size: sentences (causal) or masked copies (masked) per forward pass.
        pll: "word_l2r" or "token", for a masked model (`PLL_METHODS`).
        progress: show a progress bar.
        side_by_side: on a CPU, score `SIDE_BY_SIDE` batches at once (`_scored`); False
            for one at a time on all threads (the probe inside a training process, whose
            model may be compiled and whose memory is the run's).
    """

    pretrained: Pretrained
    device: torch.device
    batch_size: int = 128
    pll: str = "word_l2r"
    progress: bool = False
    side_by_side: bool = True

    def __post_init__(self) -> None:
        if self.pll not in PLL_METHODS:
            raise ConfigError(f"pll={self.pll} is not one of {', '.join(PLL_METHODS)}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be at least 1")

    @property
    def method(self) -> str:
        """How a sentence is scored: "causal", or "pll_word_l2r" / "pll_token"."""
        family = family_named(self.pretrained.family)
        if family.supports("score"):
            return "causal"
        if family.supports("fill-mask"):
            return f"pll_{self.pll}"
        raise ConfigError(
            f"a {family.name.upper()} model neither scores text nor fills masks: no sentence "
            "score for it"
        )

    def __call__(self, sentences: Sequence[str]) -> list[float]:
        """log p of each sentence, in nats (a pseudo-log-likelihood for a masked model)."""
        if self.method == "causal":
            return self._causal(sentences)
        return self._pseudo(sentences)

    def _causal(self, sentences: Sequence[str]) -> list[float]:
        tokenizer = _whole(self.pretrained.tokenizer)
        start = special_ids(tokenizer).document_separator
        encoded = [
            [start, *e.ids]
            for e in tokenizer.encode_batch(list(sentences), add_special_tokens=False)
        ]
        kept, same_as = _distinct(encoded)
        encoded = [encoded[i] for i in kept]
        limit = self.pretrained.model.config.max_seq_len
        _check_length(max((len(ids) - 1 for ids in encoded), default=0), limit)
        model = self.pretrained.model

        def score(rows: list[int]) -> tuple[list[int], torch.Tensor]:
            width = max(len(encoded[r]) for r in rows) - 1
            inputs = torch.full((len(rows), width), start, dtype=torch.long)
            targets = torch.zeros((len(rows), width), dtype=torch.long)
            counted = torch.zeros((len(rows), width), dtype=torch.bool)
            for row, r in enumerate(rows):
                ids = torch.tensor(encoded[r])
                inputs[row, : len(ids) - 1], targets[row, : len(ids) - 1] = ids[:-1], ids[1:]
                counted[row, : len(ids) - 1] = True
            logits = self._run(model, inputs).logits.float()
            token_logp = logits.log_softmax(-1).gather(-1, targets.to(logits.device)[..., None])
            return rows, (token_logp[..., 0] * counted.to(logits.device)).sum(-1).double().cpu()

        scores = torch.zeros(len(encoded), dtype=torch.float64)
        for rows, sums in self._scored(score, self._batches(_by_length(encoded), "sentences")):
            scores[torch.tensor(rows)] = sums
        return scores[same_as].tolist()

    def _pseudo(self, sentences: Sequence[str]) -> list[float]:
        tokenizer, model = _whole(self.pretrained.tokenizer), self.pretrained.model
        family = family_named(self.pretrained.family)
        if not isinstance(model, family.model_class):  # a head-less HF export
            raise ConfigError(
                f"{self.pretrained.source} holds a {type(model).__name__} without its MLM head; "
                f"scoring sentences needs a {family.model_class.__name__} (a run's checkpoint "
                "or its hf/ export)"
            )
        encodings = tokenizer.encode_batch(list(sentences))
        kept, same_as = _distinct([e.ids for e in encodings])
        encodings = [encodings[i] for i in kept]
        _check_length(max((len(e.ids) for e in encodings), default=0), model.config.max_seq_len)
        scores = torch.zeros(len(encodings), dtype=torch.float64)
        copies = sum(mask.count(0) for mask in (e.special_tokens_mask for e in encodings))
        word_l2r, mask = self.pll == "word_l2r", special_ids(tokenizer).mask
        bar = tqdm(total=copies, desc="scoring masked", unit=" copies", disable=not self.progress)

        def score(batch: MaskedCopies) -> tuple[MaskedCopies, torch.Tensor]:
            logits = self._run(model.mlm_logits_at, batch.ids, batch.at).float()
            target = batch.target.to(logits.device)[:, None]
            return batch, logits.log_softmax(-1).gather(-1, target)[:, 0].double().cpu()

        batches = _masked_copies(encodings, mask, self.batch_size, word_l2r=word_l2r)
        with bar:
            for batch, logp in self._scored(score, batches):
                scores.index_add_(0, batch.sentence, logp)
                bar.update(len(batch.at))
        return scores[same_as].tolist()

    def _run(self, forward: Callable[..., Any], *tensors: torch.Tensor) -> Any:
        on_device = [t.to(self.device) for t in tensors]
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):  # fp32 (above)
            return forward(*on_device)

    def _scored(
        self, score: Callable[[Batch], Scored], batches: Iterable[Batch]
    ) -> Iterator[Scored]:
        """`map(score, batches)`, in order. On a CPU of several torch threads, `SIDE_BY_SIDE`
        batches are scored at once, each on its share of the threads: a small model's
        operations are too short to keep several cores busy within one pass, two passes side
        by side do better (docs/results/cpu-bench.md, BLiMP scoring). Scores are those of
        one batch at a time on that share of the threads, and the caller sums them in batch
        order; a failing batch cancels those not yet started."""
        threads = torch.get_num_threads()
        if not self.side_by_side or self.device.type != "cpu" or threads == 1:
            yield from map(score, batches)
            return
        lanes = min(SIDE_BY_SIDE, threads)
        torch.set_num_threads(threads // lanes)  # what each pool thread reads as it starts
        pool = ThreadPoolExecutor(lanes, thread_name_prefix="sentence-scoring")
        try:
            pending: deque[Future[Scored]] = deque()
            for batch in batches:
                pending.append(pool.submit(score, batch))
                if len(pending) == 2 * lanes:  # a few ahead, not every batch at once
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
        finally:
            pool.shutdown()
            torch.set_num_threads(threads)

    def _batches(self, order: list[int], unit: str) -> Iterator[list[int]]:
        starts = range(0, len(order), self.batch_size)
        for first in tqdm(starts, desc=f"scoring {unit}", disable=not self.progress):
            yield order[first : first + self.batch_size]


@dataclass(frozen=True)
class MaskedCopies:
    """Masked copies of sentences of one length T, one copy per scored token.

    Attributes:
        sentence: (B,) the sentence each copy is of (its index in the scored list).
        ids: (B, T) the copy's ids: the sentence's, with the token at `at` (and, for word_l2r,
            the rest of its word's pieces) replaced by [MASK].
        at: (B,) the column of the token the copy scores.
        target: (B,) that token's id.
    """

    sentence: torch.Tensor
    ids: torch.Tensor
    at: torch.Tensor
    target: torch.Tensor


def _masked_copies(
    encodings, mask: int, batch_size: int, *, word_l2r: bool
) -> Iterator[MaskedCopies]:
    """A copy per scored token (every token but the specials) of every encoding, in batches of
    at most `batch_size` copies of one length, longest first: a batch needs no padding (nor an
    attention mask), and the copies of a sentence sit side by side."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, encoding in enumerate(encodings):
        by_length[len(encoding.ids)].append(index)
    for length in sorted(by_length, reverse=True):
        members = [encodings[i] for i in by_length[length]]
        ids_ST = torch.tensor([e.ids for e in members], dtype=torch.long)
        scored_ST = torch.tensor([e.special_tokens_mask for e in members]) == 0
        words_ST = torch.tensor([[-1 if w is None else w for w in e.word_ids] for e in members])
        of_C, at_C = scored_ST.nonzero(as_tuple=True)  # C: the copies of this length
        sentence_C = torch.tensor(by_length[length])[of_C]
        for first in range(0, len(at_C), batch_size):
            of_B, at_B = of_C[first : first + batch_size], at_C[first : first + batch_size]
            columns_BT = torch.arange(length).expand(len(at_B), -1)
            masked_BT = columns_BT == at_B[:, None]
            if word_l2r:  # the later pieces of the scored token's word too
                words_BT = words_ST[of_B]
                word_B1 = words_BT.gather(1, at_B[:, None])
                later_BT = (columns_BT > at_B[:, None]) & scored_ST[of_B]
                masked_BT |= later_BT & (words_BT == word_B1) & (word_B1 >= 0)
            yield MaskedCopies(
                sentence_C[first : first + batch_size],
                ids_ST[of_B].masked_fill(masked_BT, mask),
                at_B,
                ids_ST[of_B, at_B],
            )


def _whole(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that neither pads nor truncates (a tokenizer read from an HF folder
    may do either), so that every sentence is scored whole and alone."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy


def _distinct(sequences: Sequence[Sequence[int]]) -> tuple[list[int], torch.Tensor]:
    """(the index of the first of each distinct sequence, for every sequence the place of its
    own among those). Sentences the model reads as the same tokens are scored once: they get
    one score to the last bit, so a minimal pair whose two sentences are the same (BLiMP has a
    few) is a tie, whichever batches their copies would have fallen into."""
    slots: dict[tuple[int, ...], int] = {}
    kept, same_as = [], []
    for index, sequence in enumerate(sequences):
        slot = slots.setdefault(tuple(sequence), len(kept))
        if slot == len(kept):
            kept.append(index)
        same_as.append(slot)
    return kept, torch.tensor(same_as, dtype=torch.long)


def _by_length(sequences: Sequence[Sequence[int]]) -> list[int]:
    """Indices of `sequences`, longest first (batches of like lengths pad little)."""
    return sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))


def _check_length(longest: int, limit: int) -> None:
    if longest > limit:
        raise ConfigError(
            f"a sentence is {longest} tokens long and the model takes at most {limit}; leave "
            "out the longer sentences"
        )
