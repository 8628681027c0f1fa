"""GPT: parity with transformers' LlamaForCausalLM, causality, documents, KV-cache generation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.gpt import GPT, GPTConfig, positions_from_docs
from models.hf import load_hf_gpt
from tests.models.oracles import LLAMA_SIZES, hf_llama

V = 1000


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("tiny", vocab_size=V, init_std=0.1, **overrides)).eval()


@pytest.mark.parametrize("size", sorted(LLAMA_SIZES))
def test_logits_match_hf_at_all_positions(size):
    hf = hf_llama(size, tied=size != "tiny-mha", rope_theta=500000.0 if size == "tiny-mqa" else 1e4)
    ours = load_hf_gpt(hf).eval()
    ids = torch.randint(0, V, (2, 40))
    with torch.no_grad():
        diff = (ours(ids).logits - hf(input_ids=ids).logits).abs().max()
    assert diff < 1e-4


def test_left_padded_batch_matches_hf_and_unpadded_rows():
    hf = hf_llama("tiny-gqa")
    ours = load_hf_gpt(hf).eval()
    ids = torch.randint(0, V, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0: 7 real tokens after 5 pads
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        out = ours(ids, attention_mask=mask).logits
        alone = ours(ids[:1, 5:]).logits
    real = mask.bool()
    assert (out[real] - ref[real]).abs().max() < 1e-4
    assert (out[0, 5:] - alone[0]).abs().max() < 1e-4


def test_changing_token_t_leaves_earlier_logits_unchanged():
    model = tiny_gpt()
    ids = torch.randint(0, V, (1, 16))
    changed = ids.clone()
    changed[0, 9] = (ids[0, 9] + 1) % V
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-3


def test_document_mask_equals_running_documents_separately():
    model = tiny_gpt()
    docs = [torch.randint(0, V, (n,)) for n in (5, 8, 3)]
    packed = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        together = model(packed, doc_ids=doc_ids).logits[0]
        separate = torch.cat([model(d[None]).logits[0] for d in docs])
    torch.testing.assert_close(together, separate, rtol=0, atol=1e-5)


def test_positions_restart_per_document():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert positions_from_docs(doc_ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_targets_give_the_cross_entropy_of_the_logits():
    model = tiny_gpt()
    ids = torch.randint(0, V, (2, 10))
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    with torch.no_grad():
        logits = model(ids).logits
        out = model(ids, targets=targets)
    assert out.logits is None and out.hidden_states.shape == (2, 10, 64)
    torch.testing.assert_close(out.loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_init_weights_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("small", vocab_size=V))
    block = model.model.layers[0]
    residual_std = 0.02 / math.sqrt(2 * 6)
    assert abs(block.attn.wqkv.weight.std().item() - 0.02) < 1e-3
    assert abs(block.attn.wo.weight.std().item() - residual_std) < 5e-4
    assert abs(block.mlp.w2.weight.std().item() - residual_std) < 5e-4
    assert torch.equal(block.attn_norm.weight, torch.ones(512))
    assert model.lm_head is None and model.output_weight is model.model.tok_emb.weight


def test_bf16_autocast_shapes_and_dtypes():
    model = tiny_gpt()
    ids = torch.randint(0, V, (2, 10))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids).logits
        loss = model(ids, targets=ids).loss
    loss.backward()
    assert logits.shape == (2, 10, V) and logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert model.model.tok_emb.weight.grad.dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# generation


def ragged_prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 7, 5)]


def test_greedy_with_cache_equals_greedy_without_cache():
    model = tiny_gpt()
    prompts = ragged_prompts()
    cached = model.generate(prompts, 12, temperature=0)
    uncached = model.generate(prompts, 12, temperature=0, use_cache=False)
    assert cached.shape == (3, 12)
    assert torch.equal(cached, uncached)
    assert len(set(cached.flatten().tolist())) > 3  # a real continuation, not one repeated id


def test_batched_generation_equals_each_prompt_alone():
    model = tiny_gpt()
    prompts = ragged_prompts()
    batched = model.generate(prompts, 8, temperature=0)
    for row, prompt in zip(batched, prompts, strict=True):
        assert torch.equal(row, model.generate([prompt], 8, temperature=0)[0])


def test_right_padded_tensor_with_mask_equals_ragged_list():
    model = tiny_gpt()
    prompts = ragged_prompts()
    ids = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
    from_list = model.generate(prompts, 6, temperature=0)
    assert torch.equal(model.generate(ids, 6, temperature=0, attention_mask=mask), from_list)


def test_sampling_is_deterministic_with_a_seed_and_filters_work():
    model = tiny_gpt()
    prompts = ragged_prompts()
    a = model.generate(prompts, 10, temperature=1.0, top_p=0.9, seed=3)
    b = model.generate(prompts, 10, temperature=1.0, top_p=0.9, seed=3)
    assert torch.equal(a, b)
    greedy = model.generate(prompts, 10, temperature=0)
    assert torch.equal(model.generate(prompts, 10, temperature=0.7, top_k=1, seed=0), greedy)
    assert torch.equal(model.generate(prompts, 10, temperature=0.7, top_p=1e-6, seed=0), greedy)
    assert not torch.equal(model.generate(prompts, 10, temperature=5.0, seed=0), greedy)


def test_eos_stops_rows_and_pads_them_with_eos():
    model = tiny_gpt()
    prompts = ragged_prompts()
    greedy = model.generate(prompts, 10, temperature=0)
    eos = int(greedy[0, 2])
    out = model.generate(prompts, 10, temperature=0, eos_id=eos)
    first = (out[0] == eos).nonzero()[0].item()
    assert first <= 2 and (out[0, first:] == eos).all()
    for row, ref in zip(out, greedy, strict=True):  # tokens before a row's eos are unchanged
        stop = (ref == eos).nonzero()
        n = stop[0].item() + 1 if len(stop) else len(ref)
        assert torch.equal(row[:n], ref[:n])


def test_generate_rejects_bad_arguments():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([[1, 2]], 0)
    with pytest.raises(ValueError, match="at least one"):
        model.generate([[1, 2], []], 3)
    with pytest.raises(ValueError, match="temperature"):
        model.generate([[1, 2]], 3, temperature=-1.0)


def test_meta_device_model_is_materialized_by_init_weights():
    config = GPTConfig.from_preset("tiny", vocab_size=V, tie_embeddings=False)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert abs(model.lm_head.weight.std().item() - 0.02) < 2e-3
    assert torch.equal(model.model.norm.weight, torch.ones(64))


def test_generate_turns_dropout_off_and_restores_the_mode():
    model = tiny_gpt(dropout=0.5)
    prompts = ragged_prompts()
    model.train()
    out = model.generate(prompts, 6, temperature=0)
    assert model.training
    assert torch.equal(out, model.eval().generate(prompts, 6, temperature=0))


def test_generation_under_bf16_autocast():
    model = tiny_gpt()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(ragged_prompts(), 5, temperature=0)
    assert out.shape == (3, 5) and out.dtype == torch.long
