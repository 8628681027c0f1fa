"""BERT: parity with transformers' BertForPreTraining, the gathered MLM path, padding."""

from __future__ import annotations

import pytest
import torch

from models.bert import (
    BertConfig,
    BertForPreTraining,
    masked_positions_from_labels,
    pretraining_loss,
)
from models.hf import load_hf_bert
from tests.models.oracles import hf_bert, padded_batch

V = 1000


def bert_inputs(B=3, T=24, lengths=(24, 17, 9), seed=0):
    ids, mask = padded_batch(B, T, V, list(lengths), seed=seed)
    # sentence B starts halfway through each row's real tokens
    token_types = (torch.arange(T)[None] >= torch.tensor(lengths)[:, None] // 2).long() * mask
    return ids, mask, token_types


@pytest.mark.parametrize("size", ["tiny", "mini"])
def test_logits_match_hf_with_padding_and_token_types(size):
    hf = hf_bert(size)
    ours = load_hf_bert(hf).eval()
    ids, mask, token_types = bert_inputs()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=token_types)
        out = ours(ids, attention_mask=mask, token_type_ids=token_types)
    real = mask.bool()
    assert (out.mlm_logits[real] - ref.prediction_logits[real]).abs().max() < 1e-4
    assert (out.nsp_logits - ref.seq_relationship_logits).abs().max() < 1e-4


def test_loss_matches_hf_pretraining_loss():
    hf = hf_bert("tiny")
    ours = load_hf_bert(hf).eval()
    ids, mask, token_types = bert_inputs()
    masked = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.3) & mask.bool()
    labels = torch.where(masked, ids, -100)
    nsp = torch.tensor([0, 1, 1])
    with torch.no_grad():
        ref = hf(
            input_ids=ids,
            attention_mask=mask,
            token_type_ids=token_types,
            labels=labels,
            next_sentence_label=nsp,
        ).loss
        positions, targets = masked_positions_from_labels(labels)
        out = ours(ids, attention_mask=mask, token_type_ids=token_types, masked_positions=positions)
    torch.testing.assert_close(pretraining_loss(out, targets, nsp).total, ref, atol=1e-5, rtol=0)


def test_masked_positions_path_equals_full_path_at_those_positions():
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V, init_std=0.1)).eval()
    ids, mask, token_types = bert_inputs()
    labels = torch.full_like(ids, -100)
    labels[0, [1, 5, 20]] = 7
    labels[2, [3]] = 9
    positions, targets = masked_positions_from_labels(labels)
    assert positions.tolist() == [1, 5, 20, 2 * 24 + 3] and targets.tolist() == [7, 7, 7, 9]
    with torch.no_grad():
        full = model(ids, attention_mask=mask, token_type_ids=token_types)
        flat = model(
            ids, attention_mask=mask, token_type_ids=token_types, masked_positions=positions
        )
        per_row = torch.tensor([[1, 5, 20], [0, 0, 0], [3, 3, 3]])
        rows = model(ids, attention_mask=mask, token_type_ids=token_types, masked_positions=per_row)
    assert flat.mlm_logits.shape == (4, V) and rows.mlm_logits.shape == (3, 3, V)
    torch.testing.assert_close(flat.mlm_logits, full.mlm_logits.flatten(0, 1)[positions])
    torch.testing.assert_close(
        rows.mlm_logits, full.mlm_logits.gather(1, per_row[..., None].expand(-1, -1, V))
    )
    torch.testing.assert_close(flat.nsp_logits, full.nsp_logits)


# the original, and the options for pretraining from scratch (rotary positions, pre-norm)
VARIANTS = {
    "original": {},
    "rotary": {"position_encoding": "rotary"},
    "pre-norm": {"norm_placement": "pre"},
    "rotary-pre-norm": {"position_encoding": "rotary", "norm_placement": "pre"},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layers", [1, 2])
def test_logits_at_one_column_per_row_are_the_full_forwards_there(layers, variant):
    """`mlm_logits_at` runs the last block for one column per row only (what a pseudo-log-
    likelihood reads); its scores are the full forward's at those columns, with padding and
    token types, also in a model whose only block is its last, and with each option (a rotary
    query rotated by its own column's angle, a pre-norm block's residual at that column)."""
    torch.manual_seed(0)
    config = BertConfig.from_preset(
        "tiny", vocab_size=V, init_std=0.1, n_layers=layers, **VARIANTS[variant]
    )
    model = BertForPreTraining(config).eval()
    ids, mask, token_types = bert_inputs()  # rows of 24, 17 and 9 real tokens
    at = torch.tensor([23, 0, 8])
    with torch.no_grad():
        full = model(ids, attention_mask=mask, token_type_ids=token_types).mlm_logits
        only = model.mlm_logits_at(ids, at, attention_mask=mask, token_type_ids=token_types)
    assert only.shape == (3, V)
    torch.testing.assert_close(only, full[torch.arange(3), at], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_does_not_change_real_positions(variant):
    torch.manual_seed(0)
    config = BertConfig.from_preset("tiny", vocab_size=V, init_std=0.1, **VARIANTS[variant])
    model = BertForPreTraining(config).eval()
    ids = torch.randint(0, V, (2, 10))
    token_types = torch.tensor([[0] * 5 + [1] * 5] * 2)
    padded_ids = torch.cat([ids, torch.randint(0, V, (2, 6))], dim=1)  # pads hold junk ids
    padded_types = torch.cat([token_types, torch.ones(2, 6, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(2, 10), torch.zeros(2, 6)], dim=1).long()
    with torch.no_grad():
        short = model(ids, token_type_ids=token_types)
        long = model(padded_ids, attention_mask=mask, token_type_ids=padded_types)
    torch.testing.assert_close(long.mlm_logits[:, :10], short.mlm_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(long.nsp_logits, short.nsp_logits, atol=1e-5, rtol=0)


def test_bf16_autocast_shapes_and_dtypes():
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))
    ids, mask, token_types = bert_inputs()
    positions, targets = masked_positions_from_labels(torch.where(mask.bool(), ids, -100))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(
            ids, attention_mask=mask, token_type_ids=token_types, masked_positions=positions
        )
        loss = pretraining_loss(out, targets, torch.tensor([0, 1, 0])).total
    loss.backward()
    assert out.mlm_logits.shape == (len(positions), V) and out.mlm_logits.dtype == torch.bfloat16
    assert out.nsp_logits.shape == (3, 2) and out.nsp_logits.dtype == torch.bfloat16
    assert out.hidden_states.shape == (3, 24, 128) and out.pooled.shape == (3, 128)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert model.bert.embeddings.word.weight.grad.dtype == torch.float32


def test_init_weights_follows_bert_recipe():
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_preset("mini", vocab_size=V))
    layer = model.bert.layers[0]
    assert abs(layer.ff_in.weight.std().item() - 0.02) < 1e-3
    assert layer.qkv.bias.abs().max() == 0 and model.mlm_bias.abs().max() == 0
    assert torch.equal(layer.attn_norm.weight, torch.ones(256))
    # the MLM decoder is the word embedding, not a copy
    params = dict(model.named_parameters())
    assert "mlm_decoder.weight" not in params and len(params) == len(set(map(id, params.values())))


def test_sequence_longer_than_positions_fails_clearly():
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V, max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_a_rotary_encoder_reads_word_order_and_only_relative_positions():
    """Without a position table, word order reaches the encoder through the rotation alone:
    swapping two tokens changes what the others see, while shifting every position by the
    same offset changes nothing (attention reads only the distance between tokens)."""
    torch.manual_seed(0)
    config = BertConfig.from_preset("tiny", vocab_size=V, init_std=0.1, position_encoding="rotary")
    model = BertForPreTraining(config).eval()
    assert model.bert.embeddings.position is None
    ids = torch.randint(1, V, (1, 12))
    swapped = ids.clone()
    swapped[0, [2, 9]] = ids[0, [9, 2]]
    with torch.no_grad():
        out = model(ids).mlm_logits
        shifted = model(ids, position_ids=torch.arange(12) + 37).mlm_logits
        reordered = model(swapped).mlm_logits
    torch.testing.assert_close(shifted, out, atol=1e-5, rtol=0)
    assert (reordered[0, 5] - out[0, 5]).abs().max() > 1e-3  # token 5 did not move


def test_a_pre_norm_encoder_is_the_pre_norm_formula_closed_by_its_final_norm():
    """x + attn(LN(x)), then x + ffn(LN(x)), then the final LayerNorm: written out here with
    plain softmax attention, against the model."""
    torch.manual_seed(0)
    config = BertConfig.from_preset(
        "tiny", vocab_size=V, init_std=0.1, n_layers=1, norm_placement="pre"
    )
    bert = BertForPreTraining(config).eval().bert
    layer = bert.layers[0]
    ids = torch.randint(1, V, (2, 7))

    def heads(t):  # (2, 7, 128) -> (2, 2 heads, 7, 64)
        return t.view(2, 7, 2, 64).transpose(1, 2)

    with torch.no_grad():
        x = bert.embeddings(ids, None, torch.arange(7))
        q, k, v = layer.qkv(layer.attn_norm(x)).chunk(3, dim=-1)
        weights = torch.softmax(heads(q) @ heads(k).transpose(-1, -2) / 8.0, dim=-1)
        x = x + layer.attn_out((weights @ heads(v)).transpose(1, 2).reshape(2, 7, 128))
        x = x + layer.ff_out(torch.nn.functional.gelu(layer.ff_in(layer.ff_norm(x))))
        expected = bert.final_norm(x)
        got = bert(ids).hidden_states
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("norm_placement", ["post", "pre"])
def test_a_block_whose_branches_add_nothing_is_the_identity_only_when_pre_norm(norm_placement):
    """Pre-norm blocks keep the residual stream itself (x + f(LN(x))); post-LN blocks normalize
    it (LN(x + f(x))), so with both branches' outputs zeroed only a pre-norm block passes its
    input through unchanged."""
    torch.manual_seed(0)
    config = BertConfig.from_preset("tiny", vocab_size=V, norm_placement=norm_placement)
    layer = BertForPreTraining(config).bert.layers[0].eval()
    with torch.no_grad():
        for linear in (layer.attn_out, layer.ff_out):
            linear.weight.zero_()
            linear.bias.zero_()
        x = 3.0 * torch.randn(2, 6, 128) + 1.0  # far from normalized
        same = torch.allclose(layer(x, None), x)
    assert same == (norm_placement == "pre")


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("position_encoding", "alibi", "model.position_encoding='alibi' is not one of absolute"),
        ("norm_placement", "sandwich", "model.norm_placement='sandwich' is not one of post"),
    ],
)
def test_an_unknown_position_encoding_or_norm_placement_is_refused_by_name(key, value, named):
    with pytest.raises(ValueError, match=named):
        BertConfig.from_preset("tiny", **{key: value})


def test_a_rotary_encoder_with_odd_head_size_is_refused():
    with pytest.raises(ValueError, match="must be even for rotary"):
        BertConfig(d_model=30, n_heads=2, position_encoding="rotary")
