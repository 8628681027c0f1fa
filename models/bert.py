"""BERT encoder (Devlin et al. 2019) with its pre-training heads, laid out so that published
checkpoints map one to one (see `models/hf_bert.py`).

Shapes: B batch, T tokens, D width, H heads, E head size, F feed-forward width, V vocabulary,
N masked positions (flattened over the batch), P masked positions per row.

Post-LN blocks as in the original: x = LN(x + attn(x)), x = LN(x + ffn(x)); exact (erf) GELU;
learned absolute positions and token types. Two options the original does not have, for
pretraining from scratch (`BertConfig`): rotary positions on the queries and keys instead of the
position table (`position_encoding=rotary`), and pre-norm blocks, x = x + f(LN(x)), closed by a
final LayerNorm (`norm_placement=pre`). A model with either does not export to Hugging Face.

Training uses the gathered MLM path: pass `masked_positions` and the MLM head (dense + GELU +
LayerNorm + tied decoder over V words) runs on the ~15% masked tokens only, instead of all
B x T tokens; at seq 128 and V = 30522 that skips most of the head's cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.config import BertConfig
from models.hf_bert import BertMapping
from models.hf_mapping import HFMapping
from models.layers import (
    apply_rotary,
    attention,
    compute_dtype,
    fused_linear,
    merge_heads,
    rope_cos_sin,
    split_heads,
)

__all__ = [
    "BertConfig",
    "BertForPreTraining",
    "BertModel",
    "BertModelOutput",
    "BertPreTrainingLoss",
    "BertPreTrainingOutput",
    "masked_positions_from_labels",
    "pretraining_loss",
]


class BertEmbeddings(nn.Module):
    """word + position (absolute encoding only) + token type, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.d_model)
        # rotary positions rotate the queries and keys in every block instead
        self.position = None if config.rotary else nn.Embedding(config.max_seq_len, config.d_model)
        self.token_type = nn.Embedding(config.type_vocab_size, config.d_model)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        token_type_ids_BT: torch.Tensor | None,
        position_ids: torch.Tensor,
    ) -> torch.Tensor:
        """(B, T) ids -> (B, T, D)."""
        x_BTD = self.word(input_ids_BT)
        if self.position is not None:
            x_BTD = x_BTD + self.position(position_ids)
        if token_type_ids_BT is None:
            x_BTD = x_BTD + self.token_type.weight[0]
        else:
            x_BTD = x_BTD + self.token_type(token_type_ids_BT)
        return self.dropout(self.norm(x_BTD))


Rotary = tuple[torch.Tensor, torch.Tensor]  # cos, sin (B or 1, T, 1, E) of `rope_cos_sin`


class BertLayer(nn.Module):
    """Transformer block with a fused QKV projection (`qkv.weight` stacks HF query, key, value
    rows): post-LN as the original, or pre-norm (`BertConfig.norm_placement`)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        D = config.d_model
        self.n_heads = config.n_heads
        self.attn_dropout = config.attn_dropout
        self.pre_norm = config.pre_norm
        self.qkv = fused_linear(D, (D, D, D))
        self.attn_out = nn.Linear(D, D)
        self.attn_norm = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.ff_in = nn.Linear(D, config.d_ff)
        self.ff_out = nn.Linear(config.d_ff, D)
        self.ff_norm = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x_BTD: torch.Tensor,
        mask_B11T: torch.Tensor | None,
        rotary: Rotary | None = None,
        at_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); `mask_B11T` True where a key is a real token; `rotary` the
        rotation of every position, for rotary models.

        With `at_B` (B,) the block's output at column `at_B[b]` of each row only, (B, 1, D):
        the keys and values still read every token, but the query, the output projection and
        the feed-forward run on one position instead of T (the last block of a model read at
        one position per row).
        """
        h_BTD = self.attn_norm(x_BTD) if self.pre_norm else x_BTD
        if at_B is None:
            q_BTD, k_BTD, v_BTD = self.qkv(h_BTD).chunk(3, dim=-1)
        else:
            rows_B = torch.arange(len(at_B), device=at_B.device)
            x_BTD = x_BTD[rows_B, at_B][:, None]  # T = 1 for the queries and the residual
            D = x_BTD.shape[-1]
            weight, bias = self.qkv.weight, self.qkv.bias  # rows: query, key, value
            q_BTD = F.linear(h_BTD[rows_B, at_B][:, None], weight[:D], bias[:D])
            k_BTD, v_BTD = F.linear(h_BTD, weight[D:], bias[D:]).chunk(2, dim=-1)
        if rotary is not None:
            q_BTD, k_BTD = self._rotated(q_BTD, k_BTD, rotary, at_B)
        y_BHTE = attention(
            split_heads(q_BTD, self.n_heads),
            split_heads(k_BTD, self.n_heads),
            split_heads(v_BTD, self.n_heads),
            mask=mask_B11T,
            dropout_p=self.attn_dropout if self.training else 0.0,
        )
        y_BTD = self.dropout(self.attn_out(merge_heads(y_BHTE)))
        if self.pre_norm:
            x_BTD = x_BTD + y_BTD
            h_BTF = F.gelu(self.ff_in(self.ff_norm(x_BTD)))
            return x_BTD + self.dropout(self.ff_out(h_BTF))
        x_BTD = self.attn_norm(x_BTD + y_BTD)
        h_BTF = F.gelu(self.ff_in(x_BTD))
        return self.ff_norm(x_BTD + self.dropout(self.ff_out(h_BTF)))

    def _rotated(
        self, q_BTD: torch.Tensor, k_BSD: torch.Tensor, rotary: Rotary, at_B: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys rotated by their positions' angles (queries at `at_B` alone when
        given)."""
        cos, sin = rotary
        k_BSD = apply_rotary(k_BSD.unflatten(-1, (self.n_heads, -1)), cos, sin).flatten(2)
        if at_B is not None:
            rows_B = torch.arange(len(at_B), device=at_B.device)
            B = len(at_B)
            cos, sin = (t.expand(B, *t.shape[1:])[rows_B, at_B][:, None] for t in (cos, sin))
        q_BTD = apply_rotary(q_BTD.unflatten(-1, (self.n_heads, -1)), cos, sin).flatten(2)
        return q_BTD, k_BSD


@dataclass
class BertModelOutput:
    """Attributes:
    hidden_states: (B, T, D) last layer.
    pooled: (B, D) tanh(dense(hidden_states[:, 0])), the [CLS] summary.
    """

    hidden_states: torch.Tensor
    pooled: torch.Tensor


class BertModel(nn.Module):
    """Embeddings, `n_layers` blocks (post-LN, or pre-norm and a final LayerNorm) and the
    [CLS] pooler."""

    hf_mapping: ClassVar[HFMapping] = BertMapping(with_heads=False)  # HF BertModel

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.n_layers))
        # pre-norm blocks leave the residual stream un-normalized: one LayerNorm closes it
        self.final_norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.pre_norm else None
        )
        self.pooler = nn.Linear(config.d_model, config.d_model)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """BERT's initialization: Normal(0, init_std) for every matrix and embedding, zero
        biases, LayerNorm gain 1 and bias 0."""
        _init_bert_modules(self, self.config.init_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> BertModelOutput:
        """Encode a batch.

        Args:
            input_ids: (B, T) token ids.
            attention_mask: (B, T) 1 for real tokens, 0 for padding (None: no padding).
                Padded keys are excluded from every softmax, so real positions are unaffected
                by how much padding follows.
            token_type_ids: (B, T) segment ids (0 for sentence A, 1 for B); None means all 0.
            position_ids: (B, T) or (T,) positions (of the table or the rotation); None means
                0..T-1.

        Returns:
            `BertModelOutput`.
        """
        x_BTD = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        pooled_BD = torch.tanh(self.pooler(x_BTD[:, 0]))
        return BertModelOutput(hidden_states=x_BTD, pooled=pooled_BD)

    def encode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        last_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last layer's states, (B, T, D); with `last_at` (B,), only those at column
        `last_at[b]` of each row, (B, 1, D), the last block run for that column alone
        (`BertLayer.forward`'s `at_B`). Arguments as `forward`."""
        T = input_ids.shape[1]
        if self.config.max_seq_len < T:
            raise ValueError(
                f"sequence of {T} tokens exceeds model.max_seq_len={self.config.max_seq_len}"
            )
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)
        mask_B11T = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        x_BTD = self.embeddings(input_ids, token_type_ids, position_ids)
        rotary = None
        if self.config.rotary:
            E, theta = self.config.head_dim, self.config.rope_theta
            rotary = rope_cos_sin(position_ids, E, theta, compute_dtype(x_BTD))
        *layers, last = self.layers
        for layer in layers:
            x_BTD = layer(x_BTD, mask_B11T, rotary)
        x_BTD = last(x_BTD, mask_B11T, rotary, last_at)
        return x_BTD if self.final_norm is None else self.final_norm(x_BTD)

    # The backbone interface every family's backbone has (`models.heads.Backbone`), which task
    # heads, probes and corpus-initialised embeddings use instead of asking which family it is.
    def backbone(self) -> BertModel:
        return self

    @property
    def word_embeddings(self) -> nn.Embedding:
        """The input token embedding table (the MLM decoder shares it)."""
        return self.embeddings.word

    def token_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, D) last-layer states."""
        return self(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).hidden_states

    def sequence_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, D) BERT's own summary of a sequence: the pooled [CLS] state."""
        return self(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).pooled

    def train_own_features(self, trained: bool) -> None:
        """Whether the parameters only `sequence_features` uses (the [CLS] pooler) train: a head
        that never calls it freezes them, so that DDP finds no parameter without a gradient."""
        self.pooler.requires_grad_(trained)


@dataclass
class BertPreTrainingOutput:
    """Attributes:
    mlm_logits: MLM scores over V: (N, V) for flat `masked_positions`, (B, P, V) for per-row
        positions, (B, T, V) when no positions were given.
    nsp_logits: (B, 2) next-sentence scores; class 0 = B follows A, 1 = B is random (as HF).
    hidden_states: (B, T, D) encoder output.
    pooled: (B, D) pooled [CLS].
    """

    mlm_logits: torch.Tensor
    nsp_logits: torch.Tensor
    hidden_states: torch.Tensor
    pooled: torch.Tensor


class BertForPreTraining(nn.Module):
    """`BertModel` plus the MLM head (decoder tied to the word embeddings, own bias) and NSP."""

    hf_mapping: ClassVar[HFMapping] = BertMapping(with_heads=True)  # HF BertForPreTraining

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.mlm_dense = nn.Linear(config.d_model, config.d_model)
        self.mlm_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.nsp = nn.Linear(config.d_model, 2)
        self._init_heads()  # the encoder initialized itself

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialize everything: `BertModel.init_weights` and the heads alike (zero MLM
        output bias)."""
        self.bert.init_weights()
        self._init_heads()

    @torch.no_grad()
    def _init_heads(self) -> None:
        for module in (self.mlm_dense, self.mlm_norm, self.nsp):
            _init_bert_modules(module, self.config.init_std)
        nn.init.zeros_(self.mlm_bias)

    def backbone(self) -> BertModel:
        """The encoder without the pretraining heads."""
        return self.bert

    @property
    def output_bias(self) -> nn.Parameter:
        """The bias of the output layer over the vocabulary (the MLM decoder's)."""
        return self.mlm_bias

    def mlm_head(self, h_XD: torch.Tensor) -> torch.Tensor:
        """MLM scores for hidden states of any leading shape: (..., D) -> (..., V)."""
        h_XD = self.mlm_norm(F.gelu(self.mlm_dense(h_XD)))
        return F.linear(h_XD, self.bert.embeddings.word.weight, self.mlm_bias)

    def mlm_logits_at(
        self,
        input_ids: torch.Tensor,
        at_B: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MLM scores at one column of each row: (B, T) ids, (B,) columns -> (B, V).

        What pseudo-log-likelihood scoring reads (a masked copy per token, each scored at its
        mask only), at a fraction of `forward`'s cost: the last block runs its query, output
        projection and feed-forward for that column alone, and no NSP head runs; for a 2-layer
        model that is about half the work. Equal to `forward(...).mlm_logits` at those columns
        up to fp32 rounding. Other arguments as `forward`.
        """
        h_B1D = self.bert.encode(input_ids, attention_mask, token_type_ids, last_at=at_B)
        return self.mlm_head(h_B1D[:, 0])

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        masked_positions: torch.Tensor | None = None,
    ) -> BertPreTrainingOutput:
        """Encode and score MLM and NSP.

        Args:
            input_ids, attention_mask, token_type_ids, position_ids: see `BertModel.forward`.
            masked_positions: where to run the MLM head (the training path):
                - (N,) flat indices into the B x T token grid (`row * T + col`), as returned by
                  `masked_positions_from_labels` -> `mlm_logits` (N, V);
                - (B, P) column indices per row (the original BERT's `masked_lm_positions`,
                  padded with any valid index) -> `mlm_logits` (B, P, V);
                - None: every token -> (B, T, V) (inference, parity tests).

        Returns:
            `BertPreTrainingOutput`.
        """
        out = self.bert(
            input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
        )
        h_BTD = out.hidden_states
        if masked_positions is None:
            h_XD = h_BTD
        elif masked_positions.dim() == 1:
            h_XD = h_BTD.flatten(0, 1)[masked_positions]
        elif masked_positions.dim() == 2:
            index_BPD = masked_positions[:, :, None].expand(-1, -1, h_BTD.shape[-1])
            h_XD = h_BTD.gather(1, index_BPD)
        else:
            raise ValueError(
                "masked_positions must be (N,) flat indices or (B, P) per-row positions, got "
                f"shape {tuple(masked_positions.shape)}"
            )
        return BertPreTrainingOutput(
            mlm_logits=self.mlm_head(h_XD),
            nsp_logits=self.nsp(out.pooled),
            hidden_states=h_BTD,
            pooled=out.pooled,
        )


def _init_bert_modules(root: nn.Module, std: float) -> None:
    for module in root.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def masked_positions_from_labels(
    labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat masked positions and their targets from per-token MLM labels.

    Args:
        labels: (B, T) original ids at masked tokens, `ignore_index` elsewhere.
        ignore_index: the "not masked" label.

    Returns:
        positions (N,) flat indices into B x T, and targets (N,) the ids to predict there.
    """
    flat = labels.flatten()
    positions = (flat != ignore_index).nonzero().squeeze(1)
    return positions, flat[positions]


@dataclass
class BertPreTrainingLoss:
    """Attributes: total = mlm + nsp (scalars), as in the original BERT."""

    total: torch.Tensor
    mlm: torch.Tensor
    nsp: torch.Tensor


def pretraining_loss(
    output: BertPreTrainingOutput,
    mlm_targets: torch.Tensor,
    nsp_labels: torch.Tensor | None,
    ignore_index: int = -100,
) -> BertPreTrainingLoss:
    """Mean MLM cross-entropy over predicted tokens plus NSP cross-entropy.

    Args:
        output: from `BertForPreTraining.forward`.
        mlm_targets: ids aligned with `output.mlm_logits` minus its last dim ((N,), (B, P) or
            (B, T)); `ignore_index` entries (padding of per-row positions) are skipped.
        nsp_labels: (B,) 0 = B follows A, 1 = random; None skips NSP (loss 0).
        ignore_index: target value to skip.

    Returns:
        `BertPreTrainingLoss`.
    """
    logits = output.mlm_logits
    mlm = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        mlm_targets.reshape(-1),
        ignore_index=ignore_index,
    )
    if nsp_labels is None:
        nsp = torch.zeros((), device=logits.device)
    else:
        nsp = F.cross_entropy(output.nsp_logits.float(), nsp_labels)
    return BertPreTrainingLoss(total=mlm + nsp, mlm=mlm, nsp=nsp)
