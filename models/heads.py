"""Sequence-level task heads (classification and regression) over either backbone.

Shapes: B batch, T tokens, D width, C outputs (classes, or 1 for regression).

- BERT: the pooled [CLS] state (dense + tanh, pre-trained with NSP), as in Devlin et al.
- GPT: the final hidden state of the last real (non-padding) token, the only position that has
  seen the whole sequence under causal attention.
- Either, with `pooling="mean"`: the mean of the last-layer states of the real tokens, which
  needs no trained pooler (Sentence-BERT found it the best pooling for sentence features).

Text pairs are read jointly (one sequence `A [SEP] B`, a cross-encoder, as BERT does) or, with
`siamese=True`, apart: each text is its own sequence through the shared backbone, and the head
reads [u, v, |u - v|, u * v] of their features u and v (InferSent, the GLUE baselines' pair
encoder and Sentence-BERT). The elementwise terms compare the two texts directly, which a small
or briefly pretrained cross-encoder has not learned to do. A regression pair read apart can
instead be scored by the cosine similarity of u and v (`pair_score="cosine"`, Sentence-BERT's
regression objective), standardized by a batch norm, so that from its first training batch the
head predicts the targets' mean and spread: training then only has to order the pairs.

A pair read apart can also be scored by how its two texts' tokens align
(`pair_score="alignment"`): for each token of one text, the cosine similarity of its best match
among the other text's tokens, averaged over the text, both ways (BERTScore's precision and
recall, Zhang et al. 2020), from the word embeddings and from the last layer's states, so four
numbers per pair. Special tokens are left out. Mean pooling loses which words the two texts
share, which is most of what a paraphrase or entailment label follows; the alignment keeps it,
and fine-tuning teaches the states which tokens should match. The four numbers are
standardized and scored by a linear layer that the fine-tuning command first fits on the frozen
model's scores of the training examples (linear probing, then fine-tuning: Kumar et al. 2022),
so that training starts from a head that already reads them.

A batch of pairs read apart is 2B rows right-padded to its longest text, yet the first texts
of a task are often much longer than the second (RTE's premises and hypotheses): the backbone
reads the first texts and the second texts as two batches, each cut after its own longest text
(`encode_pair_sides`). Padding is masked either way, so the scores are the same, and a step
costs less (`make bench-finetune` measures by how much).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.gpt import last_token_index
from models.pooling import ChunkAttentionPooling, aggregate_chunk_logits

__all__ = [
    "PAIR_SCORES",
    "POOLINGS",
    "DocumentClassifier",
    "SequenceClassifier",
    "alignment_scores",
    "backbone_of",
    "default_pair_score",
    "encode_pair_sides",
    "last_token_index",
    "mean_token_states",
    "pair_alignment",
    "pair_cosine",
    "pair_features",
    "pair_side_widths",
    "sequence_loss",
    "split_pairs",
]


POOLINGS = (None, "mean")  # None: the family's own (BERT's pooled [CLS], GPT's last token)
PAIR_SCORES = ("features", "cosine", "alignment")  # how a siamese head scores a pair
ALIGNMENT_SCORES = 4  # per pair: both directions, at the word embeddings and the last layer


def default_pair_score(regression: bool) -> str:
    """How a pair read apart is scored unless set: by the cosine of its two texts for a
    regression, by how their tokens align for classes (docs/results/quick-suite.md: on BERT tiny it beat [u, v, |u - v|, u * v] on MRPC and RTE, pretrained and from
    scratch)."""
    return "cosine" if regression else "alignment"


class Backbone(Protocol):
    """What task heads, probes and the pipeline use of a family's backbone (the stack without its
    pretraining heads). `BertModel` and `GPTModel` have it; so does any family added later, and
    a pretraining model answers `backbone()` with its stack."""

    config: Any

    def backbone(self) -> Backbone: ...

    @property
    def word_embeddings(self) -> nn.Embedding: ...

    def token_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def sequence_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def train_own_features(self, trained: bool) -> None: ...


def backbone_of(model: nn.Module) -> Backbone:
    """The encoder or decoder stack of a model, without its pretraining heads."""
    if not callable(getattr(model, "backbone", None)):
        raise TypeError(
            f"unsupported model {type(model).__name__}: a backbone needs the `Backbone` methods "
            "(models.heads.Backbone)"
        )
    return model.backbone()


def token_states(
    backbone: Backbone,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
):
    """(B, T, D) last-layer states of any backbone."""
    return backbone.token_states(input_ids, attention_mask, token_type_ids)


def mean_token_states(
    backbone: Backbone,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, D) the mean of the last-layer states of each row's real tokens: sequence features
    that need no trained pooler (a probe's, `pipeline/pretrain/probe.py`)."""
    h_BTD = token_states(backbone, input_ids, attention_mask, token_type_ids)
    mask_BT1 = attention_mask.to(h_BTD.dtype).unsqueeze(-1)
    return (h_BTD * mask_BT1).sum(1) / mask_BT1.sum(1).clamp_min(1.0)


class SequenceClassifier(nn.Module):
    """A backbone plus dropout and a linear layer to C outputs.

    `n_outputs == 1` makes it a regression head (e.g. STS-B), scored with MSE by
    `sequence_loss`; otherwise logits over C classes. A regression head's linear layer predicts
    the standardized target: the output is `mean + std * linear(...)` with the (mean, std) of
    the training targets, so a fresh head predicts their mean, and each optimizer step moves
    the prediction in the targets' own units (STS-B's 0-5). Without it, a new head (bias 0,
    weights ~0.02) on a fine-tuning budget of a few hundred steps at lr 1e-4 cannot even reach
    the targets' mean.

    Args:
        backbone: `BertModel` or `GPTModel`, or the pre-training model wrapping one
            (`BertForPreTraining`, `GPT`), whose backbone is kept and whose LM heads are dropped.
        n_outputs: C.
        dropout: dropout before the linear layer (BERT fine-tuning uses 0.1).
        pooling: None for the family's own sequence features, "mean" for the mean token state.
        siamese: the input rows come in pairs, rows 2i and 2i+1 the two texts of example i;
            the head scores each pair (B examples from 2B rows) as `pair_score` says.
        pair_score: siamese only: "features", the linear layer on [u, v, |u - v|, u * v];
            "cosine" (regression only), cos(u, v) standardized by a one-channel batch norm
            (batch statistics in training, running ones in evaluation) and its affine map, so
            from its first training batch the head predicts the targets' mean and spread;
            "alignment", a linear layer on the pair's standardized token alignment scores
            (`alignment_scores`), to be fitted before training (`fit_alignment`).
        special_ids: token ids the alignment leaves out ([CLS], [SEP], padding...).
        target: (mean, std) of the regression targets (ignored for classification).
        init_std: std of the normal initialization of the new linear layer.
    """

    def __init__(
        self,
        backbone: nn.Module,
        n_outputs: int,
        *,
        dropout: float = 0.1,
        pooling: str | None = None,
        siamese: bool = False,
        pair_score: str = "features",
        target: tuple[float, float] = (0.0, 1.0),
        init_std: float = 0.02,
        special_ids: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        backbone = backbone_of(backbone)
        if n_outputs < 1:
            raise ValueError(f"n_outputs must be >= 1 (1 = regression), got {n_outputs}")
        if not target[1] > 0:
            raise ValueError(f"the regression target's std must be > 0, got {target[1]}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be null (the model's own) or 'mean', got {pooling!r}")
        if pair_score not in PAIR_SCORES:
            raise ValueError(f"pair_score must be one of {PAIR_SCORES}, got {pair_score!r}")
        self.cosine = siamese and pair_score == "cosine"
        if self.cosine and n_outputs != 1:
            raise ValueError(
                f"the cosine pair score is one number: a regression head, not {n_outputs} classes"
            )
        self.alignment = siamese and pair_score == "alignment"
        self.backbone = backbone
        self.n_outputs = n_outputs
        self.pooling, self.siamese = pooling, siamese
        # mean pooling or alignment leaves the backbone's own features (BERT's [CLS] pooler)
        # out of the graph: frozen, so that DDP finds no parameter without a gradient
        backbone.train_own_features(pooling is None and not self.alignment)
        self.target_mean, self.target_std = (float(t) for t in target)
        self.dropout = nn.Dropout(dropout)
        self.classifier: nn.Linear | nn.BatchNorm1d
        if self.cosine:
            self.classifier = nn.BatchNorm1d(1)
        elif self.alignment:
            self.classifier = nn.Linear(ALIGNMENT_SCORES, n_outputs)
            # the standardization of the scores, set with the layer by `fit_alignment`
            self.register_buffer("score_mean", torch.zeros(ALIGNMENT_SCORES))
            self.register_buffer("score_std", torch.ones(ALIGNMENT_SCORES))
            self.register_buffer(
                "special_ids", torch.tensor(sorted(special_ids), dtype=torch.long), persistent=False
            )
        else:
            self.classifier = nn.Linear(backbone.config.d_model * (4 if siamese else 1), n_outputs)
        self.init_std = init_std
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Only the new layer: Normal(0, init_std) weights, zero bias (the backbone is kept); the
        cosine score's norm: unit scale, zero shift, fresh running statistics."""
        if isinstance(self.classifier, nn.BatchNorm1d):
            self.classifier.reset_parameters()
            return
        nn.init.normal_(self.classifier.weight, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.classifier.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores per sequence (per pair of sequences when siamese).

        Args:
            input_ids: (N, T); siamese: N = 2B, rows 2i and 2i+1 the two texts of example i.
            attention_mask: (N, T) 1 = real token; padding may be on either side for GPT.
            token_type_ids: (N, T) segment ids (BERT only; ignored by GPT).

        Returns:
            (B, C) logits, or (B, 1) regression values.
        """
        if self.alignment:
            scores_B4 = self.alignment_scores(
                input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            standardized_B4 = (scores_B4 - self.score_mean.float()) / self.score_std.float()
            return self.classify(standardized_B4.to(self.classifier.weight.dtype))
        if self.siamese:  # the two sides of the pairs apart, each at its own width
            features_ND = encode_pair_sides(
                self.features, input_ids, attention_mask, token_type_ids
            )
        else:
            features_ND = self.features(input_ids, attention_mask, token_type_ids)
        if self.cosine:
            return self.to_target(self.standardize(pair_cosine(self.dropout(features_ND))))
        if self.siamese:
            return self.classify(pair_features(features_ND))
        return self.classify(features_ND)

    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(N, D) features of each sequence: BERT's pooled [CLS] or GPT's last token, or with
        `pooling="mean"` the mean state of its real tokens."""
        if self.pooling == "mean":
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            return mean_token_states(self.backbone, input_ids, attention_mask, token_type_ids)
        return self.backbone.sequence_features(input_ids, attention_mask, token_type_ids)

    def classify(self, features_BD: torch.Tensor) -> torch.Tensor:
        """(B, D) features (B, 4D when siamese; B, 4 standardized alignment scores) -> (B, C)
        scores: dropout (not on alignment scores), then the linear layer (for regression in
        the targets' units). Not for the cosine pair score, which scores pairs of rows
        (`forward`)."""
        if self.cosine:
            raise ValueError("a cosine pair head scores pairs of texts, not feature rows")
        if not self.alignment:
            features_BD = self.dropout(features_BD)
        scores_BC = self.classifier(features_BD)
        return self.to_target(scores_BC) if self.n_outputs == 1 else scores_BC

    def alignment_scores(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(2B, T) rows of B pairs -> (B, 4) raw alignment scores (`alignment_scores`)."""
        return alignment_scores(
            self.backbone, input_ids, attention_mask, token_type_ids, self.special_ids
        )

    @torch.no_grad()
    def fit_alignment(
        self, mean: torch.Tensor, std: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> None:
        """Set the alignment scores' standardization (mean, std: (4,)) and the linear layer
        on them (weight: (4, C), bias: (C,); for regression in standardized target units)."""
        if not self.alignment:
            raise ValueError("fit_alignment is for a head with pair_score='alignment'")
        self.score_mean.copy_(mean)
        self.score_std.copy_(std.clamp_min(1e-6))
        self.classifier.weight.copy_(weight.T)
        self.classifier.bias.copy_(bias)

    def to_target(self, standardized_B1: torch.Tensor) -> torch.Tensor:
        """A regression output in the targets' units: mean + std * the standardized value."""
        return self.target_mean + self.target_std * standardized_B1

    def standardize(self, cos_B1: torch.Tensor) -> torch.Tensor:
        """The cosine score's norm. Training: by the batch's statistics, which the running ones
        follow (the first training batch sets them, so that evaluation never meets the
        placeholder mean 0 and variance 1; then the norm's momentum); a batch of one pair has
        no spread to measure and uses the running statistics, as evaluation does."""
        norm = self.classifier
        assert isinstance(norm, nn.BatchNorm1d)
        training = self.training and cos_B1.shape[0] > 1
        momentum = norm.momentum
        if training:  # (evaluation reads no counter: no host-device sync on that path)
            if int(norm.num_batches_tracked) == 0:
                momentum = 1.0
            norm.num_batches_tracked.add_(1)
        return F.batch_norm(
            cos_B1,
            norm.running_mean,
            norm.running_var,
            norm.weight,
            norm.bias,
            training=training,
            momentum=momentum,
            eps=norm.eps,
        )


def pair_cosine(features_ND: torch.Tensor) -> torch.Tensor:
    """(2B, D) features of B text pairs (rows 2i, 2i+1) -> (B, 1) cos(u, v)."""
    u_BD, v_BD = split_pairs(features_ND)
    return F.cosine_similarity(u_BD, v_BD, dim=-1).unsqueeze(-1)


def word_embeddings(backbone: Backbone) -> nn.Embedding:
    """The backbone's input word (token) embedding table."""
    return backbone.word_embeddings


def alignment_scores(
    backbone: Backbone,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    special_ids: torch.Tensor,
) -> torch.Tensor:
    """(2B, T) rows of B text pairs -> (B, 4) alignment scores (`pair_alignment`) of the word
    embeddings, then of the last layer's states; tokens in `special_ids` and padding left out."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    content_NT = attention_mask.bool() & ~torch.isin(input_ids, special_ids.to(input_ids.device))
    words_NTD = word_embeddings(backbone)(input_ids)
    states_NTD = encode_pair_sides(
        partial(token_states, backbone), input_ids, attention_mask, token_type_ids
    )
    return torch.cat(
        [pair_alignment(words_NTD, content_NT), pair_alignment(states_NTD, content_NT)], -1
    )


def pair_alignment(h_NTD: torch.Tensor, content_NT: torch.Tensor) -> torch.Tensor:
    """(2B, T, D) token vectors of B text pairs (rows 2i, 2i+1) and (2B, T) which tokens count
    -> (B, 2): for each counted token of one text, the cosine similarity of its best match
    among the other text's counted tokens, averaged over the text; text 1 to 2, then 2 to 1.
    A pair where either text has no counted token scores 0 both ways."""
    with torch.autocast(h_NTD.device.type, enabled=False):  # cosines a few 1e-3 apart matter
        a_BTD, b_BTD = split_pairs(F.normalize(h_NTD.float(), dim=-1))
        sim_BTT = a_BTD @ b_BTD.transpose(1, 2)
    in_a_BT, in_b_BT = split_pairs(content_NT)
    # a token's best match is among the other text's counted tokens; -2 is below any cosine
    sim_BTT = sim_BTT.masked_fill(~in_b_BT[:, None, :], -2.0).masked_fill(
        ~in_a_BT[:, :, None], -2.0
    )
    a_to_b = _masked_mean(sim_BTT.amax(2), in_a_BT)
    b_to_a = _masked_mean(sim_BTT.amax(1), in_b_BT)
    both_B = in_a_BT.any(1) & in_b_BT.any(1)
    return torch.stack([a_to_b, b_to_a], -1) * both_B.unsqueeze(-1)


def _masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    weight_BT = mask_BT.to(values_BT.dtype)
    return (values_BT * weight_BT).sum(1) / weight_BT.sum(1).clamp_min(1.0)


def encode_pair_sides(
    encode: Callable[..., torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """`encode(ids, mask, types)` of (2B, T) rows of B text pairs, run on the first texts
    (rows 2i) and on the second texts (rows 2i + 1) apart, each side cut to its own width
    (`pair_side_widths`): (2B, ...) outputs in the rows' order, per-token outputs (2B, T, D)
    padded back to T with zeros. Padding is masked, so each row's output is what one batch of
    all 2B rows gives (to float rounding); with right padding, a side of short texts costs its
    own length, not the longest text of the batch. Without a mask, `encode` of all the rows."""
    if attention_mask is None:
        return encode(input_ids, attention_mask, token_type_ids)
    rows = [
        None if t is None else split_pairs(t) for t in (input_ids, attention_mask, token_type_ids)
    ]
    sides = []
    for side, width in enumerate(pair_side_widths(attention_mask)):
        ids, mask, types = (None if t is None else t[side][:, :width] for t in rows)
        out = encode(ids, mask, types)
        if out.dim() == 3:  # per token: back to the batch's T columns
            out = F.pad(out, (0, 0, 0, input_ids.shape[1] - width))
        sides.append(out)
    return torch.stack(sides, 1).flatten(0, 1)


def pair_side_widths(attention_mask: torch.Tensor) -> tuple[int, int]:
    """The columns each side of (2B, T) rows of B text pairs needs: up to the last column where
    any first text (rows 2i), or any second text (rows 2i + 1), has a real token; at least 1.
    One host-device sync."""
    first, second = split_pairs(attention_mask)
    real_2T = torch.stack([first.bool().any(0), second.bool().any(0)])
    columns_T = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    first_width, second_width = (real_2T * columns_T).amax(1).clamp_min(1).tolist()
    return first_width, second_width


def split_pairs(features_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2B, D) rows of B text pairs -> u (B, D) from rows 2i, v (B, D) from rows 2i + 1."""
    if features_ND.shape[0] % 2:
        raise ValueError(f"a siamese batch holds pairs of rows, got {features_ND.shape[0]} rows")
    return features_ND[0::2], features_ND[1::2]


def pair_features(features_ND: torch.Tensor) -> torch.Tensor:
    """(2B, D) features of B text pairs (rows 2i, 2i+1) -> (B, 4D) [u, v, |u - v|, u * v]."""
    u_BD, v_BD = split_pairs(features_ND)
    return torch.cat([u_BD, v_BD, (u_BD - v_BD).abs(), u_BD * v_BD], dim=-1)


class DocumentClassifier(nn.Module):
    """Scores documents from their sliding-window chunks (N chunks of M documents).

    - "mean" / "max": every chunk is scored by the sequence classifier; a document's scores
      are the mean or per-class max of its chunks' (`aggregate_chunk_logits`). Trained per
      chunk, each chunk with its document's label.
    - "attention": the chunks' features are pooled per document by learned attention
      (`ChunkAttentionPooling`) and the pooled vector is scored. Trained per document.

    Args:
        classifier: the `SequenceClassifier` that scores (or featurizes) each chunk.
        aggregate: "mean", "max" or "attention".
    """

    def __init__(self, classifier: SequenceClassifier, aggregate: str = "mean") -> None:
        super().__init__()
        if aggregate not in ("mean", "max", "attention"):
            raise ValueError(f"aggregate must be 'mean', 'max' or 'attention', got {aggregate!r}")
        self.classifier = classifier
        self.aggregate = aggregate
        d_model = classifier.backbone.config.d_model
        self.pooling = ChunkAttentionPooling(d_model) if aggregate == "attention" else None

    def forward(
        self,
        input_ids: torch.Tensor,
        chunk_doc: torch.Tensor,
        num_docs: int,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Chunk and document scores.

        Args:
            input_ids: (N, T) chunks.
            chunk_doc: (N,) document of each chunk, in [0, num_docs).
            num_docs: M.

        Returns:
            (chunk scores (N, C), or None with attention pooling; document scores (M, C)).
        """
        features_ND = self.classifier.features(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        )
        if self.pooling is not None:
            return None, self.classifier.classify(self.pooling(features_ND, chunk_doc, num_docs))
        chunk_NC = self.classifier.classify(features_ND)
        return chunk_NC, aggregate_chunk_logits(chunk_NC, chunk_doc, num_docs, self.aggregate)


def sequence_loss(logits_BC: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for C > 1 classes (integer labels), MSE for regression (C == 1)."""
    if logits_BC.shape[-1] == 1:
        return F.mse_loss(logits_BC.squeeze(-1).float(), labels_B.float())
    return F.cross_entropy(logits_BC.float(), labels_B)
