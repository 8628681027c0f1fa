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
from omegaconf import DictConfig
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from pipeline.run.errors import ConfigError


def check_optimizer_values(optim: DictConfig, lr_by_default: bool = False) -> None:
    """Refuse optimizer settings no optimizer can take, before anything is made: a learning
    rate that is not a number above 0, negative weight decay, betas outside [0, 1), an eps not
    above 0. `lr_by_default`: `optim.lr=null` picks a default (fine-tuning, by model width)."""
    lr = optim.get("lr")
    if not (lr is None and lr_by_default) and not (is_number(lr) and lr > 0):
        default = " (or optim.lr=null for the default by model width)" if lr_by_default else ""
        raise ConfigError(f"optim.lr={lr!r}: give a learning rate > 0, e.g. optim.lr=1e-4{default}")
    adamw_lr = optim.get("adamw_lr")  # Muon's rate for the parameters AdamW updates; null: lr
    if adamw_lr is not None and not (is_number(adamw_lr) and adamw_lr > 0):
        raise ConfigError(f"optim.adamw_lr={adamw_lr!r}: give a rate > 0, or null to use optim.lr")
    for key in ("weight_decay", "adamw_weight_decay"):
        value = optim.get(key)
        if value is not None and not (is_number(value) and value >= 0):
            raise ConfigError(f"optim.{key}={value!r}: give a number >= 0, e.g. optim.{key}=0.01")
    for i, beta in enumerate(optim.get("betas") or []):
        if not (is_number(beta) and 0 <= beta < 1):
            raise ConfigError(f"optim.betas[{i}]={beta!r}: give a number in [0, 1), e.g. 0.9")
    eps = optim.get("eps")
    if eps is not None and not (is_number(eps) and eps > 0):
        raise ConfigError(f"optim.eps={eps!r}: give a number > 0, e.g. optim.eps=1e-8")


def is_number(value: object) -> bool:
    """An int or a float, not a bool (YAML's `true` is not a learning rate)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


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
