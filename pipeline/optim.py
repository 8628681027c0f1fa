"""Optimizer construction: AdamW with decoupled weight decay on weight matrices only.

Decay is applied to the weight matrices of linear layers. Biases, norm gains and embedding tables
are excluded: decaying a norm gain or a bias pulls it towards a value with no special meaning
(a gain of 0 silences the layer), and an embedding row is only updated when its token occurs, so
decay would shrink rare tokens' vectors far more than frequent ones'. This follows BERT (no decay
on LayerNorm and bias) and nanoGPT/Llama practice (decay on matrices, not on embeddings). A tied
output layer shares the embedding table, so it is not decayed either.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split `model`'s trainable parameters into a decayed and a non-decayed group.

    Returns:
        Two param groups for a torch optimizer: linear-layer weight matrices with
        `weight_decay`, everything else (biases, norms, embeddings) with 0. Each parameter
        appears once, even when shared (tied embeddings).
    """
    # Chosen by the owning layer, not by shape: under FSDP the parameters are flat 1-D shards
    # by the time the optimizer is built.
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        is_matrix = id(param) in linear_weights and id(param) not in embedding_weights
        (decay if is_matrix else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, optimizer_factory: Callable[..., torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    """Bind a partial optimizer from `conf/optim/` to `model` with weight-decay groups.

    The factory's own `weight_decay` keyword (from the config) sets the decayed group's rate.
    """
    keywords = getattr(optimizer_factory, "keywords", {})
    groups = weight_decay_groups(model, keywords.get("weight_decay", 0.0))
    return optimizer_factory(groups)
