"""Building blocks shared by BERT and GPT, written once.

Dimension names used in shapes and name suffixes throughout `models/`:
    B batch, T tokens (queries), S keys (cached + new tokens), D model width, H query heads,
    K key/value heads, E head size, F feed-forward width, V vocabulary, N flattened rows.

Nothing here owns parameters except `SwiGLU`; the rest are functions so that both model files
call the same code (attention core, rotary embeddings, the fused output-layer loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------------------
# Attention core


def split_heads(x_BTX: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reshape a projection into heads without copying.

    Args:
        x_BTX: (B, T, n_heads * E).
        n_heads: number of heads in the last dimension.

    Returns:
        (B, n_heads, T, E), a strided view (SDPA accepts it as is, so no `.contiguous()`).
    """
    B, T, _ = x_BTX.shape
    return x_BTX.view(B, T, n_heads, -1).transpose(1, 2)


def merge_heads(x_BHTE: torch.Tensor) -> torch.Tensor:
    """(B, H, T, E) -> (B, T, H * E), the inverse of `split_heads`."""
    B, H, T, E = x_BHTE.shape
    return x_BHTE.transpose(1, 2).reshape(B, T, H * E)


def attention(
    q_BHTE: torch.Tensor,
    k_BKSE: torch.Tensor,
    v_BKSE: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Scaled dot-product attention through `F.scaled_dot_product_attention`.

    Grouped-query attention (K < H) is handed to SDPA's `enable_gqa`, which broadcasts each
    key/value head over its H / K query heads instead of materializing repeated copies.

    Args:
        q_BHTE: queries (B, H, T, E).
        k_BKSE: keys (B, K, S, E); K divides H.
        v_BKSE: values (B, K, S, E).
        mask: optional boolean mask broadcastable to (B, H, T, S); True means "may attend".
            Every query row must allow at least one key, otherwise the softmax is undefined.
        is_causal: lower-triangular mask aligned at the top-left (only valid when T == S);
            cheaper than an explicit mask and selects the flash kernel on GPU.
        dropout_p: dropout on attention probabilities (pass 0.0 in eval mode).

    Returns:
        (B, H, T, E).
    """
    gqa = k_BKSE.shape[1] != q_BHTE.shape[1]
    return F.scaled_dot_product_attention(
        q_BHTE,
        k_BKSE,
        v_BKSE,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=gqa,
    )


# ----------------------------------------------------------------------------------------------
# Rotary position embeddings (RoPE), in the "rotate half" layout used by Llama / Hugging Face,
# so that checkpoints map without permuting the query/key rows.


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of the rotary angles for the given positions.

    The angles are computed in float32 whatever `dtype` is: in bfloat16, positions above ~256
    cannot be represented exactly and the rotation would drift. The frequencies are recomputed
    on every call (E / 2 numbers) rather than kept in a buffer, so `model.to(bfloat16)` or
    meta-device initialization cannot degrade them.

    Args:
        position_ids: (B, T) or (T,) integer positions.
        head_dim: E, even.
        theta: RoPE base.
        dtype: dtype of the returned tables (the dtype of q and k).

    Returns:
        cos, sin of shape (B, T, 1, E) (or (1, T, 1, E)), broadcastable over heads of a
        (B, T, heads, E) tensor.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponent / head_dim))
    angles_BTe = position_ids[..., None].float() * inv_freq
    angles_BTE = torch.cat((angles_BTe, angles_BTe), dim=-1)
    return angles_BTE.cos().to(dtype)[:, :, None], angles_BTE.sin().to(dtype)[:, :, None]


def apply_rotary(x_BTnE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + E/2) of every head by the position's angle.

    Args:
        x_BTnE: (B, T, n, E) queries and/or keys (any number of heads n).
        cos, sin: (B or 1, T, 1, E) from `rope_cos_sin`.

    Returns:
        (B, T, n, E), same dtype as `x_BTnE`.
    """
    x1, x2 = x_BTnE.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_BTnE * cos + rotated * sin


# ----------------------------------------------------------------------------------------------
# Fused projections


def fused_linear(d_in: int, rows: tuple[int, ...], bias: bool = True) -> nn.Linear:
    """One `nn.Linear` computing several projections of the same input in one matmul: its
    weight stacks their (rows_i, d_in) matrices. `fused_rows` records the split, for code that
    must treat the matrices apart (Muon orthogonalizes each one, `pipeline/training/muon.py`)."""
    linear = nn.Linear(d_in, sum(rows), bias=bias)
    linear.fused_rows = tuple(rows)
    return linear


# Feed-forward


class SwiGLU(nn.Module):
    """Gated feed-forward `w2(silu(w1 x) * w3 x)` with w1 and w3 fused into one matmul.

    `w13.weight` stacks w1 (the gate, HF `gate_proj`) on top of w3 (HF `up_proj`), so one
    (D -> 2F) matmul replaces two and the HF mapping is a concatenation along dim 0.
    """

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w13 = fused_linear(d_model, (d_ff, d_ff), bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D)."""
        gate_BTF, up_BTF = self.w13(x_BTD).chunk(2, dim=-1)
        return self.w2(F.silu(gate_BTF) * up_BTF)


# ----------------------------------------------------------------------------------------------
# Output layer + cross-entropy without materializing all logits


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `x` runs in: the autocast dtype when autocast is on, else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _chunk_rows(n_rows: int, vocab: int, device: torch.device) -> int:
    # Chunks of ~128 MiB of float32 logits on CPU: smaller, cache-sized chunks were measured
    # slower, because each chunk streams the whole (V, D) weight and its gradient through memory
    # again. ~512 MiB on GPUs: large matmuls, few launches, bounded memory.
    budget = 2**25 if device.type == "cpu" else 2**27
    return max(1, min(n_rows, budget // vocab))


class _LinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of `h @ w.T` whose gradients are computed chunk by chunk in the forward.

    Standard `F.cross_entropy(F.linear(h, w), y)` keeps N x V logits, their log-softmax and
    their gradient alive: for GPT mini (N = 4096, V = 50304) that is three 800 MB tensors that
    dominate a CPU step. Here each chunk's logits are turned into (softmax - one_hot) in place
    and immediately multiplied back, so the peak extra memory is one chunk, and every
    elementwise pass (max, exp, sum, scaling) runs once per chunk in place. The arithmetic is
    that of the unfused version.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, h_ND, w_VD, targets_N, ignore_index, reduction, chunk, grad_enabled
    ) -> torch.Tensor:
        # `ctx.needs_input_grad` is True even under no_grad, so the caller says whether a
        # backward can follow; without one the gradient work is skipped.
        want_grad_h = grad_enabled and ctx.needs_input_grad[0]
        want_grad_w = grad_enabled and ctx.needs_input_grad[1]
        dtype = compute_dtype(h_ND)
        # Casts are explicit (autocast off) so the in-place float32 accumulations are well defined
        # and the matmuls still run in the autocast dtype.
        with torch.autocast(h_ND.device.type, enabled=False):
            w = w_VD.to(dtype)
            acc = torch.promote_types(dtype, torch.float32)  # softmax and sums: >= float32
            valid_N = targets_N != ignore_index
            n_valid = valid_N.sum()
            scale = 1.0 / n_valid.clamp(min=1) if reduction == "mean" else torch.ones(())
            scale = scale.to(device=h_ND.device, dtype=acc)
            safe_targets = targets_N.clamp(min=0)
            grad_h = torch.empty_like(h_ND) if want_grad_h else None
            grad_w = torch.zeros(w_VD.shape, device=w_VD.device, dtype=acc) if want_grad_w else None
            loss = torch.zeros((), device=h_ND.device, dtype=acc)
            rows = torch.arange(chunk, device=h_ND.device)
            for start in range(0, h_ND.shape[0], chunk):
                end = min(start + chunk, h_ND.shape[0])
                h = h_ND[start:end].to(dtype)
                t, valid = safe_targets[start:end], valid_N[start:end]
                logits = (h @ w.T).to(acc)
                target_logit = logits.gather(1, t[:, None]).squeeze(1)
                # logsumexp by hand, so the exponentials are computed once, in place, and
                # reused as the softmax for the gradient.
                row_max = logits.amax(dim=-1, keepdim=True)
                probs = logits.sub_(row_max).exp_()
                row_sum = probs.sum(dim=-1)
                lse = row_max.squeeze(1) + row_sum.log()
                loss += ((lse - target_logit) * valid).sum()
                if grad_h is None and grad_w is None:
                    continue
                # d loss / d logits = (softmax - one_hot) * scale, zero on ignored rows.
                row_scale = valid * scale
                dlogits = probs.mul_((row_scale / row_sum)[:, None])
                dlogits[rows[: end - start], t] -= row_scale
                dlogits = dlogits.to(dtype)
                if grad_h is not None:
                    grad_h[start:end] = dlogits @ w
                if grad_w is not None:
                    if dtype == acc:
                        grad_w.addmm_(dlogits.T, h)
                    else:  # the matmul in the autocast dtype (as unfused autocast runs it)
                        grad_w.add_(dlogits.T @ h)
        # Kept as attributes, not saved tensors: they are private buffers that backward scales
        # in place (no second V x D allocation) and hands over, hence one backward per forward.
        ctx.grads = (grad_h, grad_w.to(w_VD.dtype) if grad_w is not None else None)
        return loss * scale

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy supports a single backward per forward")
        grads = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in ctx.grads]
        ctx.grads = None
        return *grads, None, None, None, None, None


def linear_cross_entropy(
    h_ND: torch.Tensor,
    w_VD: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """`F.cross_entropy(h @ w.T, targets)` without holding the (N, V) logits.

    Args:
        h_ND: final hidden states (N, D).
        w_VD: output projection (V, D) (the tied embedding for tied models).
        targets_N: target ids (N,); `ignore_index` entries contribute nothing.
        ignore_index: target value to skip.
        reduction: "mean" over non-ignored targets, or "sum".
        chunk_rows: rows per chunk; by default sized for the device.

    Returns:
        Scalar loss in float32 (float64 for float64 inputs); 0 when every target is ignored.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    chunk = chunk_rows or _chunk_rows(h_ND.shape[0], w_VD.shape[0], h_ND.device)
    grad_enabled = torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad)
    return _LinearCrossEntropy.apply(
        h_ND, w_VD, targets_N, ignore_index, reduction, chunk, grad_enabled
    )
