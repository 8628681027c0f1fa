"""CUDA-only checks (skipped without a GPU): bf16 training steps and generation on device."""

from __future__ import annotations

import pytest
import torch

from models.bert import (
    BertConfig,
    BertForPreTraining,
    masked_positions_from_labels,
    pretraining_loss,
)
from models.gpt import GPT, GPTConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_bert_bf16_step_on_gpu():
    model = BertForPreTraining(BertConfig.from_preset("mini", vocab_size=1000)).cuda()
    ids = torch.randint(0, 1000, (4, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    positions, targets = masked_positions_from_labels(torch.where(mask.bool(), ids, -100))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(ids, attention_mask=mask, masked_positions=positions)
        loss = pretraining_loss(out, targets, torch.zeros(4, dtype=torch.long, device="cuda")).total
    loss.backward()
    assert out.mlm_logits.dtype == torch.bfloat16 and torch.isfinite(loss)


def test_gpt_bf16_step_matches_cpu_and_generates_on_gpu():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("mini", vocab_size=1000, init_std=0.1)).cuda()
    ids = torch.randint(0, 1000, (2, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, targets=ids).loss
    loss.backward()
    with torch.no_grad():
        fp32 = model(ids, targets=ids).loss
    assert torch.isfinite(loss) and abs(loss.item() - fp32.item()) < 0.05 * fp32.item()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cached = model.generate(prompts, 8, temperature=0)
    assert torch.equal(cached, model.generate(prompts, 8, temperature=0, use_cache=False))
