"""optim=muon (pipeline/training/muon.py): Muon on the transformer blocks' matrices, AdamW on the rest,
in one optimizer whose step and state are exactly those of the two parts."""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
from torch import nn

from models.bert import BertForPreTraining
from models.config import BertConfig, GPTConfig
from models.gpt import GPT
from pipeline.pretrain.checks import check_config
from pipeline.run.errors import ConfigError
from pipeline.run.launcher import GroupChoices
from pipeline.training import precision
from pipeline.training.muon import MuonWithAdamW, fast_dtype, orthogonalize
from pipeline.training.optim import build_optimizer
from tests.conftest import compose_pretrain, run_pretrain

GPT_CONFIG = GPTConfig(
    vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32
)
BERT_CONFIG = BertConfig(
    vocab_size=256, d_model=64, n_layers=2, n_heads=2, d_ff=128, max_seq_len=32
)
MUON = functools.partial(MuonWithAdamW, lr=2e-3, weight_decay=0.1, adamw_lr=1e-3)
# torch.optim.Muon orthogonalizes in bf16: compared with it in bf16
MUON_BF16 = functools.partial(MUON, ns_dtype="bfloat16")


def grouped_names(model, optimizer) -> tuple[set[str], set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    return muon, adamw


@pytest.mark.parametrize(
    "model", [GPT(GPT_CONFIG), BertForPreTraining(BERT_CONFIG)], ids=["gpt", "bert"]
)
def test_the_blocks_matrices_get_muon_and_everything_else_adamw(model):
    optimizer = build_optimizer(model, MUON)
    muon, adamw = grouped_names(model, optimizer)
    assert muon.isdisjoint(adamw)
    assert muon | adamw == {n for n, p in model.named_parameters() if p.requires_grad}
    params = dict(model.named_parameters())
    assert all(params[n].ndim == 2 and ".layers." in n for n in muon)
    assert len(muon) == 4 * 2  # attention in and out, feed-forward in and out, per block
    # embeddings, norms, biases and heads stay with AdamW, at its own learning rate
    assert any("emb" in n or "embeddings" in n for n in adamw)
    assert any("norm" in n for n in adamw)
    assert {g["lr"] for g in optimizer.param_groups if g["muon"]} == {2e-3}
    assert {g["lr"] for g in optimizer.param_groups if not g["muon"]} == {1e-3}


def gpt_step(model, seed: int) -> None:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(ids, targets=ids).loss.backward()


def test_one_step_is_muons_on_the_matrices_and_adamws_on_the_rest():
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    alone = copy.deepcopy(model)
    combined = build_optimizer(model, MUON_BF16)  # fused weights whole, as torch's Muon does
    muon_names, _ = grouped_names(model, combined)
    params = dict(alone.named_parameters())
    muon_alone = torch.optim.Muon(
        [params[n] for n in sorted(muon_names)],
        lr=2e-3,
        weight_decay=0.1,
        adjust_lr_fn="match_rms_adamw",
    )
    adamw_alone = torch.optim.AdamW(
        [p for n, p in params.items() if n not in muon_names],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.0,  # GPT's other parameters: embeddings and norms, not decayed
    )
    for seed in range(3):
        for m, optimizers in ((model, [combined]), (alone, [muon_alone, adamw_alone])):
            gpt_step(m, seed)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    for name, param in model.named_parameters():
        assert torch.allclose(param, dict(alone.named_parameters())[name], atol=1e-7), name


@pytest.mark.parametrize(
    "model", [GPT(GPT_CONFIG), BertForPreTraining(BERT_CONFIG)], ids=["gpt", "bert"]
)
def test_fused_projections_are_split_into_their_matrices(model):
    assert not any(build_optimizer(model, MUON).param_groups[0]["row_blocks"])  # the default
    optimizer = build_optimizer(model, functools.partial(MUON, split_fused=True))
    (group,) = [g for g in optimizer.param_groups if g["muon"]]
    names = {id(p): n for n, p in model.named_parameters()}
    pairs = zip(group["params"], group["row_blocks"], strict=True)
    blocks = {names[id(p)].split(".")[-2]: b for p, b in pairs}  # the same in every layer
    if isinstance(model, GPT):  # 4 query heads and 2 key/value heads of 16; SwiGLU gate and up
        d_ff = GPT_CONFIG.d_ff
        assert blocks == {"wqkv": (64, 32, 32), "wo": None, "w13": (d_ff, d_ff), "w2": None}
    else:
        assert blocks == {"qkv": (64, 64, 64), "attn_out": None, "ff_in": None, "ff_out": None}


def test_a_fused_weight_steps_as_its_matrices_would_apart():
    """Each block of a fused weight gets torch's Muon step of that block alone (its own
    orthogonalization and learning-rate scale), which differs from the step of the stack."""
    generator = torch.Generator().manual_seed(0)
    rows = (48, 24, 24)
    start = torch.randn(96, 32, generator=generator)
    fused, whole = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    parts = [nn.Parameter(block.clone()) for block in start.split(rows)]
    settings = {"lr": 1e-2, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    ours = MuonWithAdamW(
        [{"params": [fused], "muon": True, "row_blocks": [rows]}], ns_dtype="bfloat16", **settings
    )
    stacked = MuonWithAdamW([{"params": [whole], "muon": True}], ns_dtype="bfloat16", **settings)
    reference = torch.optim.Muon(parts, **settings)
    for _ in range(3):
        grad = torch.randn(96, 32, generator=generator)
        fused.grad, whole.grad = grad.clone(), grad.clone()
        for part, block in zip(parts, grad.split(rows), strict=True):
            part.grad = block.clone()
        for optimizer in (ours, stacked, reference):
            optimizer.step()
    assert torch.allclose(fused, torch.cat(list(parts)), atol=1e-7)
    assert not torch.allclose(whole, fused, atol=1e-4)


def test_orthogonalizing_in_fp32_gives_singular_values_near_one():
    grad = torch.randn(48, 160, generator=torch.Generator().manual_seed(0))
    for matrix in (grad, grad.T):  # wide and tall
        singular = torch.linalg.svdvals(orthogonalize(matrix, 5, torch.float32))
        assert singular.min() > 0.5 and singular.max() < 1.3
        assert orthogonalize(matrix, 5, torch.float32).shape == matrix.shape


def test_the_orthogonalization_is_bf16_only_where_the_cpu_has_it(monkeypatch):
    fast_dtype.cache_clear()
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx2"})
    assert fast_dtype(torch.device("cpu")) == torch.float32
    fast_dtype.cache_clear()
    monkeypatch.setattr(precision, "cpu_flags", lambda: {"avx512_bf16"})
    assert fast_dtype(torch.device("cpu")) == torch.bfloat16
    fast_dtype.cache_clear()


def test_a_restored_optimizer_continues_exactly():
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    optimizer = build_optimizer(model, MUON)
    gpt_step(model, 0)
    optimizer.step()
    optimizer.zero_grad()
    saved_model, saved_state = (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(optimizer.state_dict()),
    )
    gpt_step(model, 1)
    optimizer.step()

    restored = GPT(GPT_CONFIG)
    restored.load_state_dict(saved_model)
    again = build_optimizer(restored, MUON)
    again.load_state_dict(saved_state)
    assert {k: type(v) for k, v in again.state[next(iter(again.state))].items()}  # moments back
    gpt_step(restored, 1)
    again.step()
    for (name, a), b in zip(model.named_parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b), name


def check_as_the_command_would(*overrides: str):
    """check_config with the config groups' options, as `make pretrain` passes them."""
    choices = compose_pretrain(*overrides, hydra_node=True).hydra.runtime.choices
    return check_config(compose_pretrain(*overrides), GroupChoices.of(choices, overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # Muon came with the preset's recipe: the family's AdamW recipe removes it
            ["model=gpt", "trainer=fsdp"],
            r"use trainer=ddp, or with FSDP the AdamW recipe \(recipe=gpt-reference\)$",
        ),
        (  # and for BERT it removes the unigram bias too, which FSDP would refuse next
            ["model=bert", "trainer=fsdp"],
            r"with FSDP the AdamW recipe \(recipe=bert-reference\)$",
        ),
        (  # Muon chosen apart from the recipe: another recipe would keep it
            ["model=gpt", "optim=muon", "trainer=fsdp"],
            r"use trainer=ddp, or with FSDP an AdamW optimizer \(optim=adamw_gpt\)$",
        ),
        (
            ["model=gpt", "optim=muon", "recipe=gpt-reference", "trainer=fsdp"],
            r"use trainer=ddp, or with FSDP an AdamW optimizer \(optim=adamw_gpt\)$",
        ),
        (  # typed, though it is the recipe's own option: a recipe= would not override it
            ["model=gpt", "optim=muon_gpt", "trainer=fsdp"],
            r"use trainer=ddp, or with FSDP an AdamW optimizer \(optim=adamw_gpt\)$",
        ),
        (["model=gpt", "optim=muon", "optim.adjust_lr_fn=sqrt"], "optim.adjust_lr_fn='sqrt'"),
        (["model=gpt", "optim=muon", "optim.momentum=1.5"], "optim.momentum must be in"),
    ],
)
def test_muon_settings_that_cannot_work_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_as_the_command_would(*overrides)


@pytest.mark.parametrize(
    ("overrides", "refusals"),
    [
        (["model=gpt", "trainer=fsdp"], 1),
        (["model=bert", "trainer=fsdp"], 1),  # the recipe brought Muon and the unigram bias
        (["model=gpt", "optim=muon", "trainer=fsdp"], 1),
        (["model=gpt", "optim=muon", "recipe=gpt-reference", "trainer=fsdp"], 1),
        # Muon typed, the unigram bias from the recipe: each refusal names its own fix
        (["model=bert", "optim=muon_bert", "trainer=fsdp"], 2),
    ],
)
def test_the_fsdp_fixes_named_pass_the_check_when_pasted(overrides, refusals):
    """The option each refusal names, put in place of the one of its group on the command line
    (or added), removes what was refused, and after `refusals` of them the check accepts."""
    seen = []
    for _ in range(refusals):
        with pytest.raises(ConfigError, match="trainer=fsdp") as refusal:
            check_as_the_command_would(*overrides)
        message = str(refusal.value)
        assert message not in seen, f"the fix named did not remove the refusal: {message}"
        seen.append(message)
        fix = re.search(r"\((\w+)=([\w-]+)\)$", message)
        assert fix, message
        key, option = fix.groups()
        overrides = [o for o in overrides if not o.startswith(f"{key}=")] + [f"{key}={option}"]
    check_as_the_command_would(*overrides)


def test_the_pretrain_command_names_the_fix_for_the_option_typed(tmp_path):
    """`make pretrain` gives the check its group options: Muon typed on the command line is
    refused with the AdamW option to type instead (a recipe= would not override it)."""
    done = run_pretrain(tmp_path, "model=gpt-tiny", "optim=muon", "trainer=fsdp", timeout=300)
    assert done.returncode != 0
    assert "with FSDP an AdamW optimizer (optim=adamw_gpt)" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # refused before a run folder was made
