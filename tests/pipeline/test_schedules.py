import itertools
import math

import pytest
import torch

from pipeline.training.schedules import resolve_warmup, warmup_cosine, warmup_linear_decay


def lrs(scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def make_optimizer(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_linear_warmup_then_decay_to_zero():
    sched = warmup_linear_decay(make_optimizer(2.0), total_steps=100, warmup_steps=10)
    values = lrs(sched, 101)
    assert values[0] == pytest.approx(0.2)  # first step already learns: 1/10 of the peak
    assert values[9] == pytest.approx(2.0)  # peak at the last warmup step
    assert values[10] == pytest.approx(2.0)
    assert values[55] == pytest.approx(2.0 * 45 / 90)
    assert values[100] == pytest.approx(0.0)
    assert all(a <= b for a, b in itertools.pairwise(values[:10]))
    assert all(a >= b for a, b in itertools.pairwise(values[10:]))


def test_warmup_ratio():
    assert resolve_warmup(1000, None, 0.1) == 100
    sched = warmup_linear_decay(make_optimizer(), total_steps=50, warmup_ratio=0.2)
    assert lrs(sched, 10)[9] == pytest.approx(1.0)


def test_cosine_reaches_min_ratio():
    sched = warmup_cosine(make_optimizer(1.0), total_steps=110, warmup_steps=10, min_lr_ratio=0.1)
    values = lrs(sched, 111)
    assert values[9] == pytest.approx(1.0)
    assert values[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[110] == pytest.approx(0.1)


def test_no_warmup():
    sched = warmup_cosine(make_optimizer(1.0), total_steps=10, warmup_steps=0)
    assert lrs(sched, 1)[0] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("steps", "ratio", "match"),
    [
        (None, None, "exactly one"),
        (10, 0.1, "exactly one"),
        (None, 1.5, "warmup_ratio"),
        (-1, None, "warmup_steps"),
    ],
)
def test_bad_warmup(steps, ratio, match):
    with pytest.raises(ValueError, match=match):
        resolve_warmup(100, steps, ratio)
