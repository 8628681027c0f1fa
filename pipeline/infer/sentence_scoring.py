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
a time, the copies of many sentences side by side, each scoring one token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from pipeline.checkpoint.load import Pretrained
from pipeline.run.errors import ConfigError
from pipeline.run.families import family_named
from tokenizer import special_ids

PLL_METHODS = ("word_l2r", "token")


@dataclass(frozen=True)
class SentenceScorer:
    """Scores sentences with a model on `device` (it must already be there).

    Args:
        pretrained: the model and its tokenizer.
        device: where the model is.
        batch_size: sentences (causal) or masked copies (masked) per forward pass.
        pll: "word_l2r" or "token", for a masked model (`PLL_METHODS`).
        progress: show a progress bar.
    """

    pretrained: Pretrained
    device: torch.device
    batch_size: int = 128
    pll: str = "word_l2r"
    progress: bool = False

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
        limit = self.pretrained.model.config.max_seq_len
        _check_length(max(len(ids) - 1 for ids in encoded), limit)
        scores = torch.zeros(len(encoded), dtype=torch.float64)
        for rows in self._batches(_by_length(encoded), "sentences"):
            width = max(len(encoded[r]) for r in rows) - 1
            inputs = torch.full((len(rows), width), start, dtype=torch.long)
            targets = torch.zeros((len(rows), width), dtype=torch.long)
            counted = torch.zeros((len(rows), width), dtype=torch.bool)
            for row, r in enumerate(rows):
                ids = torch.tensor(encoded[r])
                inputs[row, : len(ids) - 1], targets[row, : len(ids) - 1] = ids[:-1], ids[1:]
                counted[row, : len(ids) - 1] = True
            logits = self._run(inputs).logits.float()
            token_logp = logits.log_softmax(-1).gather(-1, targets.to(logits.device)[..., None])
            sums = (token_logp[..., 0] * counted.to(logits.device)).sum(-1).double().cpu()
            scores[torch.tensor(rows)] = sums
        return scores.tolist()

    def _pseudo(self, sentences: Sequence[str]) -> list[float]:
        tokenizer, model = _whole(self.pretrained.tokenizer), self.pretrained.model
        family = family_named(self.pretrained.family)
        if not isinstance(model, family.model_class):  # a head-less HF export
            raise ConfigError(
                f"{self.pretrained.source} holds a {type(model).__name__} without its MLM head; "
                f"scoring sentences needs a {family.model_class.__name__} (a run's checkpoint "
                "or its hf/ export)"
            )
        mask = special_ids(tokenizer).mask
        encodings = tokenizer.encode_batch(list(sentences))
        _check_length(max(len(e.ids) for e in encodings), model.config.max_seq_len)
        copies = list(_masked_copies(encodings, mask, word_l2r=self.pll == "word_l2r"))
        scores = torch.zeros(len(encodings), dtype=torch.float64)
        order = _by_length([c.ids for c in copies])
        for rows in self._batches(order, "masked copies"):
            batch = [copies[r] for r in rows]
            width = max(len(c.ids) for c in batch)
            inputs = torch.zeros((len(batch), width), dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, copy in enumerate(batch):
                inputs[row, : len(copy.ids)] = torch.tensor(copy.ids)
                attention[row, : len(copy.ids)] = 1
            positions = torch.tensor([[c.position] for c in batch])
            out = self._run(
                inputs,
                attention_mask=attention,
                token_type_ids=torch.zeros_like(inputs),
                masked_positions=positions,
            )
            logp = out.mlm_logits[:, 0].float().log_softmax(-1)
            targets = torch.tensor([c.target for c in batch], device=logp.device)
            picked = logp.gather(-1, targets[:, None])[:, 0].double().cpu()
            scores.index_add_(0, torch.tensor([c.sentence for c in batch]), picked)
        return scores.tolist()

    def _run(self, inputs: torch.Tensor, **tensors: torch.Tensor):
        on_device = {k: v.to(self.device) for k, v in tensors.items()}
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):  # fp32 (above)
            return self.pretrained.model(inputs.to(self.device), **on_device)

    def _batches(self, order: list[int], unit: str) -> Iterator[list[int]]:
        starts = range(0, len(order), self.batch_size)
        for first in tqdm(starts, desc=f"scoring {unit}", disable=not self.progress):
            yield order[first : first + self.batch_size]


@dataclass(frozen=True)
class MaskedCopy:
    """A sentence's ids with one token (and, for word_l2r, the rest of its word) masked."""

    sentence: int
    ids: list[int]
    position: int
    target: int


def _masked_copies(encodings, mask: int, *, word_l2r: bool) -> Iterator[MaskedCopy]:
    """A copy per scored token (every token but the specials) of every encoding."""
    for index, encoding in enumerate(encodings):
        ids, words = encoding.ids, encoding.word_ids
        scored = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
        for position in scored:
            copy = list(ids)
            masked = [position]
            if word_l2r and words[position] is not None:
                masked += [i for i in scored if i > position and words[i] == words[position]]
            for i in masked:
                copy[i] = mask
            yield MaskedCopy(index, copy, position, ids[position])


def _whole(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that neither pads nor truncates (a tokenizer read from an HF folder
    may do either), so that every sentence is scored whole and alone."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy


def _by_length(sequences: Sequence[Sequence[int]]) -> list[int]:
    """Indices of `sequences`, longest first (batches of like lengths pad little)."""
    return sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))


def _check_length(longest: int, limit: int) -> None:
    if longest > limit:
        raise ConfigError(
            f"a sentence is {longest} tokens long and the model takes at most {limit}; leave "
            "out the longer sentences"
        )
