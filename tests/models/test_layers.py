"""Shared layers against hand-written references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.layers import (
    SwiGLU,
    apply_rotary,
    attention,
    linear_cross_entropy,
    merge_heads,
    rope_cos_sin,
    split_heads,
)


def reference_attention(q, k, v, mask=None, causal=False):
    """Softmax attention written out, repeating key/value heads for GQA."""
    H, K = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_matches_reference_with_gqa_and_masks(n_kv_heads):
    torch.manual_seed(0)
    B, H, T, E = 2, 4, 7, 8
    q = torch.randn(B, H, T, E)
    k, v = torch.randn(B, n_kv_heads, T, E), torch.randn(B, n_kv_heads, T, E)
    causal = attention(q, k, v, is_causal=True)
    torch.testing.assert_close(causal, reference_attention(q, k, v, causal=True))
    key_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)[:, None, None, :]
    masked = attention(q, k, v, mask=key_mask)
    torch.testing.assert_close(masked, reference_attention(q, k, v, mask=key_mask))


def test_split_and_merge_heads_are_inverse():
    x = torch.randn(2, 5, 12)
    assert split_heads(x, 3).shape == (2, 3, 5, 4)
    torch.testing.assert_close(merge_heads(split_heads(x, 3)), x)


def test_rope_matches_hf_llama_rotary():
    hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = hf.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    B, T, H, E = 2, 9, 4, 16
    positions = torch.stack([torch.arange(T), torch.arange(T) + 100])
    q = torch.randn(B, H, T, E)
    cos_hf, sin_hf = hf.LlamaRotaryEmbedding(config)(q, positions)
    expected, _ = hf.apply_rotary_pos_emb(q, q, cos_hf, sin_hf)
    cos, sin = rope_cos_sin(positions, E, 500000.0, torch.float32)
    ours = apply_rotary(q.transpose(1, 2), cos, sin).transpose(1, 2)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_rope_tables_are_computed_in_float32_then_cast():
    positions = torch.arange(4000, 4010)
    cos, sin = rope_cos_sin(positions, 8, 10000.0, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    cos32, _ = rope_cos_sin(positions, 8, 10000.0, torch.float32)
    torch.testing.assert_close(cos.float(), cos32.to(torch.bfloat16).float())


def test_rope_rotation_preserves_norm_and_is_relative():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq, pk):
        cq, sq = rope_cos_sin(torch.tensor([pq]), 16, 10000.0, torch.float32)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 16, 10000.0, torch.float32)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    torch.testing.assert_close(score(3, 1), score(13, 11))
    cos, sin = rope_cos_sin(torch.tensor([5]), 16, 10000.0, torch.float32)
    torch.testing.assert_close(apply_rotary(q, cos, sin).norm(), q.norm())


def test_swiglu_is_w2_of_silu_w1_times_w3():
    torch.manual_seed(0)
    mlp = SwiGLU(8, 12)
    w1, w3 = mlp.w13.weight.split(12)
    x = torch.randn(2, 3, 8)
    expected = (F.silu(x @ w1.T) * (x @ w3.T)) @ mlp.w2.weight.T
    torch.testing.assert_close(mlp(x), expected)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_linear_cross_entropy_matches_unfused_loss_and_grads(reduction, chunk_rows):
    torch.manual_seed(0)
    N, D, V = 10, 6, 17
    h = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    targets[[2, 7]] = -100
    loss = linear_cross_entropy(h, w, targets, reduction=reduction, chunk_rows=chunk_rows)
    (2.5 * loss).backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    expected = F.cross_entropy(F.linear(h, w), targets, reduction=reduction)
    (2.5 * expected).backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0], h.grad)
    torch.testing.assert_close(grads[1], w.grad)


def test_linear_cross_entropy_without_grad_and_under_bf16_autocast():
    torch.manual_seed(0)
    h, w = torch.randn(8, 16), torch.randn(32, 16, requires_grad=True)
    targets = torch.randint(0, 32, (8,))
    expected = F.cross_entropy(h @ w.T, targets)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, targets), expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, targets)
    loss.backward()
    assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_linear_cross_entropy_grads_under_bf16_autocast_match_unfused_autocast(chunk_rows):
    """Under autocast the gradient matmuls run in bf16 (as autograd's would), accumulated over
    chunks in float32: the gradients agree with unfused autocast to bf16 precision."""
    torch.manual_seed(0)
    N, D, V = 64, 32, 200
    h0, w0 = torch.randn(N, D), torch.randn(V, D) * 0.3
    targets = torch.randint(0, V, (N,))
    grads = []
    for fused in (True, False):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                loss = linear_cross_entropy(h, w, targets, chunk_rows=chunk_rows)
            else:
                loss = F.cross_entropy(F.linear(h, w).float(), targets)
        loss.backward()
        grads.append((h.grad, w.grad))
    for ours, unfused in zip(*grads, strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, unfused, rtol=0.03, atol=2e-4)


def test_linear_cross_entropy_refuses_a_second_backward():
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 16, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="single backward"):
        loss.backward()
