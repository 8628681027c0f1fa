"""Parameter counts and FLOPs per token against hand counts of tiny configs."""

from __future__ import annotations

import pytest

from models.bert import BertConfig, BertForPreTraining
from models.flops import flops_per_token, param_count
from models.gpt import GPT, GPTConfig


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) parameters appear once


# A GPT small enough to count by hand: V=10, D=4, L=1, H=2 (E=2), K=1, F=6, T=8.
GPT_TINY = dict(
    vocab_size=10, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=6, max_seq_len=8
)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_hand_count(tied):
    c = GPTConfig(**GPT_TINY, tie_embeddings=tied)
    embedding = 10 * 4  # 40
    qkv = 4 * (2 + 2 * 1) * 2  # 32: D x (H + 2K) E
    wo = 4 * 4  # 16
    mlp = 3 * 4 * 6  # 72
    norms = 2 * 4 + 4  # 12: two per block + final
    head = 0 if tied else 40
    body = qkv + wo + mlp + norms + head  # 132 (+ 40 untied)
    assert param_count(c) == embedding + body == numel(GPT(c))
    assert param_count(c, embeddings=False) == body
    attention = 12 * 1 * 2 * 2 * 8  # 12 L H E T = 384
    output_matmul = 40  # the output layer multiplies every token, tied or not
    assert flops_per_token(c) == 6 * (qkv + wo + mlp + norms + output_matmul) + attention
    assert flops_per_token(c, seq_len=4) == flops_per_token(c) - attention / 2


def test_bert_hand_count():
    c = BertConfig(vocab_size=10, n_layers=1, d_model=4, n_heads=2, d_ff=8, max_seq_len=6)
    embeddings = (10 + 6 + 2) * 4  # 72: word, position, token type
    emb_norm = 8
    layer = (3 * 16 + 12) + (16 + 4) + 8 + (4 * 8 + 8) + (8 * 4 + 4) + 8  # 172
    pooler, nsp = 16 + 4, 8 + 2  # 20, 10
    mlm = 16 + 4 + 8 + 10  # 38: transform dense, LayerNorm, output bias (decoder is tied)
    assert param_count(c) == embeddings + emb_norm + layer + pooler + nsp + mlm
    assert param_count(c) == numel(BertForPreTraining(c))
    assert param_count(c, embeddings=False) == emb_norm + layer + pooler + nsp + mlm
    attention = 12 * 1 * 2 * 2 * 6  # 288
    decoder = 40
    full = 6 * (emb_norm + layer + (pooler + nsp) / 6 + mlm + decoder) + attention
    assert flops_per_token(c) == pytest.approx(full)
    gathered = 6 * (emb_norm + layer + (pooler + nsp) / 6 + 0.15 * (mlm + decoder)) + attention
    assert flops_per_token(c, predicted_fraction=0.15) == pytest.approx(gathered)


@pytest.mark.parametrize("preset", ["tiny", "mini"])
def test_counts_match_built_models(preset):
    for config, build in (
        (GPTConfig.from_preset(preset, vocab_size=300), GPT),
        (BertConfig.from_preset(preset, vocab_size=300), BertForPreTraining),
        (
            BertConfig.from_preset(
                preset, vocab_size=300, position_encoding="rotary", norm_placement="pre"
            ),
            BertForPreTraining,
        ),
    ):
        assert param_count(config) == numel(build(config))


def test_124m_preset_is_124m_class():
    assert 120e6 < param_count(GPTConfig.from_preset("124m")) < 130e6
