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
from torch.optim.lr_scheduler import LambdaLR


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
    # an optimizer that groups parameters its own way says how (pipeline.training.muon)
    grouping = getattr(
        getattr(optimizer_factory, "func", optimizer_factory), "group_parameters", None
    )
    if grouping is not None:
        return optimizer_factory(grouping(model, **keywords))
    groups = weight_decay_groups(model, keywords.get("weight_decay", 0.0))
    return optimizer_factory(groups)


# What a resumed run takes from its own config rather than from the checkpoint.
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "momentum")


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
    `conf/optim/`. Here the configured values win; the moments and step counts stay. The
    schedule's shape (and length, `trainer.max_steps`) is this run's already; the learning rate
    of the step about to run is set from it at the (possibly new) peak, so the first resumed
    step runs where this run's schedule says, exactly as an uninterrupted run with this config
    would at that step. (A schedule other than `LambdaLR` is only rescaled by the new peak.)

    Args:
        optimizer: the restored optimizer.
        scheduler: its restored schedule (its `base_lrs` are the checkpoint's peaks).
        configured: `group_hyperparameters` of the optimizer as this run built it.

    Returns:
        One line per distinct change, e.g. "lr: 0.001 -> 0.0005" (a change that several
        parameter groups share is listed once).
    """
    if len(configured) != len(optimizer.param_groups):
        raise ValueError(
            f"the optimizer has {len(optimizer.param_groups)} parameter groups but "
            f"{len(configured)} were configured; they cannot be matched"
        )
    changes = []
    for i, (group, wanted) in enumerate(zip(optimizer.param_groups, configured, strict=True)):
        for key, value in wanted.items():
            saved = scheduler.base_lrs[i] if key == "lr" else group[key]
            if key == "betas":
                saved, value = tuple(saved), tuple(value)
            if saved == value:
                continue
            changes.append(f"{key}: {saved} -> {value}")
            if key == "lr":
                if not isinstance(scheduler, LambdaLR):
                    group["lr"] = group["lr"] / saved * value if saved else value
                group["initial_lr"] = scheduler.base_lrs[i] = value
            else:
                group[key] = value
    if isinstance(scheduler, LambdaLR):
        for group, base, factor in zip(
            optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return list(dict.fromkeys(changes))
