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


# What a resumed run takes from its own config rather than from the checkpoint.
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's hyperparameters, as built (`lr` is the peak, before any schedule)."""
    return [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in optimizer.param_groups]


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    configured: list[dict],
) -> list[str]:
    """Give an optimizer and schedule restored from a checkpoint this run's hyperparameters.

    Restoring a checkpoint brings back each group's learning rate, betas, eps and weight decay
    with the optimizer's moments, so a resumed run would silently ignore new values in
    `conf/optim/` (the schedule's shape already comes from this run's config). Here the
    configured values win; the moments and step counts stay. A new peak learning rate rescales
    the current one, so the schedule continues from the same point at the new height.

    Args:
        optimizer: the restored optimizer.
        scheduler: its restored schedule (its `base_lrs` are the checkpoint's peaks).
        configured: `group_hyperparameters` of the optimizer as this run built it.

    Returns:
        One line per value changed, e.g. "group 0 lr: 0.001 -> 0.0005".
    """
    if len(configured) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(optimizer.param_groups)} parameter groups and "
            f"this run's has {len(configured)}; they cannot be matched"
        )
    changes = []
    for i, (group, wanted) in enumerate(zip(optimizer.param_groups, configured, strict=True)):
        for key, value in wanted.items():
            saved = scheduler.base_lrs[i] if key == "lr" else group[key]
            if key == "betas":
                saved, value = tuple(saved), tuple(value)
            if saved == value:
                continue
            changes.append(f"group {i} {key}: {saved} -> {value}")
            if key == "lr":
                group["lr"] = group["lr"] / saved * value if saved else value
                group["initial_lr"] = scheduler.base_lrs[i] = value
            else:
                group[key] = value
    return changes
