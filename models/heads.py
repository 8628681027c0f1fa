"""Sequence-level task heads (classification and regression) over either backbone.

Shapes: B batch, T tokens, D width, C outputs (classes, or 1 for regression).

- BERT: the pooled [CLS] state (dense + tanh, pre-trained with NSP), as in Devlin et al.
- GPT: the final hidden state of the last real (non-padding) token, the only position that has
  seen the whole sequence under causal attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.bert import BertForPreTraining, BertModel
from models.gpt import GPT, GPTModel

__all__ = ["SequenceClassifier", "last_token_index", "sequence_loss"]


def last_token_index(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row, for left or right padding. (B, T) -> (B,)."""
    T = attention_mask_BT.shape[1]
    positions_BT = torch.arange(T, device=attention_mask_BT.device).expand_as(attention_mask_BT)
    return (positions_BT * attention_mask_BT.bool()).amax(dim=1)


class SequenceClassifier(nn.Module):
    """A backbone plus dropout and a linear layer to C outputs.

    `n_outputs == 1` makes it a regression head (e.g. STS-B), scored with MSE by
    `sequence_loss`; otherwise logits over C classes.

    Args:
        backbone: `BertModel` or `GPTModel`, or the pre-training model wrapping one
            (`BertForPreTraining`, `GPT`), whose backbone is kept and whose LM heads are dropped.
        n_outputs: C.
        dropout: dropout before the linear layer (BERT fine-tuning uses 0.1).
        init_std: std of the normal initialization of the new linear layer.
    """

    def __init__(
        self,
        backbone: BertModel | GPTModel | BertForPreTraining | GPT,
        n_outputs: int,
        *,
        dropout: float = 0.1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if isinstance(backbone, BertForPreTraining):
            backbone = backbone.bert
        elif isinstance(backbone, GPT):
            backbone = backbone.model
        if not isinstance(backbone, BertModel | GPTModel):
            raise TypeError(f"unsupported backbone {type(backbone).__name__}; use BERT or GPT")
        if n_outputs < 1:
            raise ValueError(f"n_outputs must be >= 1 (1 = regression), got {n_outputs}")
        self.backbone = backbone
        self.n_outputs = n_outputs
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(backbone.config.d_model, n_outputs)
        self.init_std = init_std
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Only the new layer: Normal(0, init_std) weights, zero bias (the backbone is kept)."""
        nn.init.normal_(self.classifier.weight, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.classifier.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores per sequence.

        Args:
            input_ids: (B, T).
            attention_mask: (B, T) 1 = real token; padding may be on either side for GPT.
            token_type_ids: (B, T) segment ids (BERT only; ignored by GPT).

        Returns:
            (B, C) logits, or (B, 1) regression values.
        """
        if isinstance(self.backbone, BertModel):
            features_BD = self.backbone(
                input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).pooled
        else:
            h_BTD = self.backbone(input_ids, attention_mask=attention_mask)
            if attention_mask is None:
                features_BD = h_BTD[:, -1]
            else:
                rows = torch.arange(h_BTD.shape[0], device=h_BTD.device)
                features_BD = h_BTD[rows, last_token_index(attention_mask)]
        return self.classifier(self.dropout(features_BD))


def sequence_loss(logits_BC: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for C > 1 classes (integer labels), MSE for regression (C == 1)."""
    if logits_BC.shape[-1] == 1:
        return F.mse_loss(logits_BC.squeeze(-1).float(), labels_B.float())
    return F.cross_entropy(logits_BC.float(), labels_B)
