import functools

import torch
from torch import nn

from pipeline.optim import build_optimizer, weight_decay_groups


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
