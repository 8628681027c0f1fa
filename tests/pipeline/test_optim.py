import functools

import pytest
import torch
from torch import nn

from pipeline.training.optim import (
    apply_hyperparameters,
    build_optimizer,
    group_hyperparameters,
    weight_decay_groups,
)
from pipeline.training.schedules import warmup_cosine


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.rms = nn.RMSNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_only_linear_matrices_are_decayed():
    model = TinyLM()
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p is model.proj.weight for p in decay["params"]] == [True]
    expected = {
        id(model.emb.weight),
        id(model.proj.bias),
        id(model.norm.weight),
        id(model.norm.bias),
        id(model.rms.weight),
    }
    assert {id(p) for p in no_decay["params"]} == expected  # tied head counted once, frozen out


def test_build_optimizer_uses_config_weight_decay():
    model = TinyLM()
    factory = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    optimizer = build_optimizer(model, factory)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    assert optimizer.defaults["lr"] == 1e-3


def _trained(lr: float, betas=(0.9, 0.95), weight_decay=0.1, steps: int = 0):
    """A TinyLM's optimizer and schedule after `steps` steps, and its configured values."""
    torch.manual_seed(0)
    model = TinyLM()
    factory = functools.partial(torch.optim.AdamW, lr=lr, betas=betas, weight_decay=weight_decay)
    optimizer = build_optimizer(model, factory)
    configured = group_hyperparameters(optimizer)
    scheduler = warmup_cosine(optimizer, total_steps=10, warmup_steps=2)
    for _ in range(steps):
        model.proj(model.emb(torch.tensor([1, 2]))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return optimizer, scheduler, configured


def test_a_resumed_optimizer_takes_this_runs_hyperparameters_and_keeps_its_moments():
    saved_optimizer, saved_scheduler, _ = _trained(1e-3, steps=4)
    # A resume as Lightning does it: this run builds its own, then loads the checkpoint's state.
    optimizer, scheduler, configured = _trained(5e-4, betas=(0.8, 0.99), weight_decay=0.05)
    optimizer.load_state_dict(saved_optimizer.state_dict())
    scheduler.load_state_dict(saved_scheduler.state_dict())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * scheduler.lr_lambdas[0](4))

    changes = apply_hyperparameters(optimizer, scheduler, configured)

    # Once per distinct change; the non-decayed group's weight decay of 0 did not change.
    assert changes == [
        "lr: 0.001 -> 0.0005",
        "betas: (0.9, 0.95) -> (0.8, 0.99)",
        "weight_decay: 0.1 -> 0.05",
    ]
    for group in optimizer.param_groups:
        assert group["lr"] == pytest.approx(5e-4 * scheduler.lr_lambdas[0](4))
        assert group["initial_lr"] == 5e-4 and group["betas"] == (0.8, 0.99)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    scheduler.step()  # the schedule goes on from step 4 at the new peak
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4 * scheduler.lr_lambdas[0](5))
    saved_state = saved_optimizer.state_dict()["state"]  # moments and step counts: the checkpoint's
    for index, state in optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], saved_state[index]["exp_avg"]) and state["step"] == 4


def test_a_resumed_step_runs_at_this_runs_schedule():
    """Resumed with a longer schedule (another total), the step about to run takes this
    schedule's rate at that step at once, not one step later."""
    saved_optimizer, saved_scheduler, _ = _trained(1e-3, steps=4)
    torch.manual_seed(0)
    factory = functools.partial(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    optimizer = build_optimizer(TinyLM(), factory)
    configured = group_hyperparameters(optimizer)
    longer = warmup_cosine(optimizer, total_steps=40, warmup_steps=2)
    optimizer.load_state_dict(saved_optimizer.state_dict())
    longer.load_state_dict(saved_scheduler.state_dict())
    assert apply_hyperparameters(optimizer, longer, configured) == []
    for group in optimizer.param_groups:
        assert group["lr"] == pytest.approx(1e-3 * longer.lr_lambdas[0](4))
    assert longer.get_last_lr() == [g["lr"] for g in optimizer.param_groups]
    assert longer.lr_lambdas[0](4) != pytest.approx(saved_scheduler.lr_lambdas[0](4))


def test_unchanged_hyperparameters_change_nothing():
    optimizer, scheduler, configured = _trained(1e-3, steps=3)
    lrs = [g["lr"] for g in optimizer.param_groups]
    assert apply_hyperparameters(optimizer, scheduler, configured) == []
    assert [g["lr"] for g in optimizer.param_groups] == lrs


def test_a_different_number_of_parameter_groups_is_refused():
    optimizer, scheduler, configured = _trained(1e-3)
    with pytest.raises(ValueError, match="2 parameter groups but 1 were configured"):
        apply_hyperparameters(optimizer, scheduler, configured[:1])
