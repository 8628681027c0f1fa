"""Llama-style decoder: pre-norm RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Shapes: B batch, T new tokens, S keys (cached + new), D width, H query heads, K key/value heads,
E head size, F SwiGLU width, V vocabulary.

`GPTModel` is the backbone (token ids -> final normed hidden states), reused by the task heads;
`GPT` adds the output layer, the training loss and KV-cache generation.

Padding and documents, one rule for all entry points:
- `attention_mask` (B, S), 1 for real tokens, 0 for padding, any padding side. Padded keys are
  never attended to, and default positions count real tokens only (cumsum of the mask), so a
  left-padded row computes exactly what the unpadded row would.
- `doc_ids` (B, T) for packed training sequences: attention is block-diagonal causal (a token
  sees only earlier tokens of its own document) and positions restart at 0 in every document.
- Neither: plain causal attention through SDPA `is_causal=True` (the flash kernel on GPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from models.hf_llama import LlamaMapping
from models.hf_mapping import HFMapping
from models.layers import (
    SwiGLU,
    apply_rotary,
    attention,
    compute_dtype,
    fused_linear,
    linear_cross_entropy,
    merge_heads,
    rope_cos_sin,
)
from models.sampling import _left_align, _sample

__all__ = ["GPT", "GPTConfig", "GPTModel", "GPTOutput", "KVCache"]


class KVCache:
    """Preallocated keys and values of every layer for incremental decoding.

    Attributes:
        keys, values: per layer, (B, K, S_max, E).
        length: number of positions already written (the same for every row; padded rows keep
            their pads in the cache and the attention mask hides them).
    """

    def __init__(
        self,
        config: GPTConfig,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.max_len = max_len
        self.length = 0

    def update(
        self, layer: int, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values for `layer`; return all keys/values so far (B, K, S, E)."""
        end = self.length + k_BKTE.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, step needs {end}")
        self.keys[layer][:, :, self.length : end] = k_BKTE
        self.values[layer][:, :, self.length : end] = v_BKTE
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def positions_from_docs(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 wherever the document id changes. (B, T) -> (B, T)."""
    T = doc_ids_BT.shape[1]
    idx_T = torch.arange(T, device=doc_ids_BT.device)
    is_start_BT = torch.ones_like(doc_ids_BT, dtype=torch.bool)
    is_start_BT[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    start_BT = torch.where(is_start_BT, idx_T, 0).cummax(dim=1).values
    return idx_T - start_BT


def positions_from_mask(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only (pads get 0). (B, S) -> (B, S)."""
    return (attention_mask_BS.long().cumsum(dim=1) - 1).clamp(min=0)


def build_attention_mask(
    T: int,
    past: int,
    *,
    attention_mask_BS: torch.Tensor | None,
    doc_ids_BT: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, T, S) for T new queries after `past` cached keys, or None.

    None means "plain causal", which the caller runs as SDPA `is_causal=True` (first chunk) or
    unmasked (a single new token attends to every cached key).
    """
    if attention_mask_BS is None and doc_ids_BT is None and (past == 0 or T == 1):
        return None
    q_T1 = torch.arange(past, past + T, device=device)[:, None]
    k_1S = torch.arange(past + T, device=device)[None, :]
    allowed_BTS = (k_1S <= q_T1)[None]
    if attention_mask_BS is not None:
        allowed_BTS = allowed_BTS & attention_mask_BS.bool()[:, None, :]
    if doc_ids_BT is not None:
        allowed_BTS = allowed_BTS & (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :])
    # A padding query may have no visible key; letting every query see itself keeps its softmax
    # finite (its output is never used) and changes nothing for real tokens.
    allowed_BTS = allowed_BTS | (k_1S == q_T1)[None]
    return allowed_BTS[:, None]


class GPTAttention(nn.Module):
    """Causal grouped-query self-attention with one fused QKV projection.

    `wqkv.weight` stacks HF `q_proj` (H*E rows), `k_proj` (K*E) and `v_proj` (K*E).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        self.wqkv = fused_linear(config.d_model, (q_rows, kv_rows, kv_rows), bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=False)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); `mask` from `build_attention_mask` (None: plain causal)."""
        B, T, _ = x_BTD.shape
        H, K = self.n_heads, self.n_kv_heads
        qkv_BTnE = self.wqkv(x_BTD).view(B, T, H + 2 * K, self.head_dim)
        # Queries and keys are rotated together: one kernel instead of two.
        qk_BTnE = apply_rotary(qkv_BTnE[:, :, : H + K], cos, sin)
        q_BHTE = qk_BTnE[:, :, :H].transpose(1, 2)
        k_BKTE = qk_BTnE[:, :, H:].transpose(1, 2)
        v_BKTE = qkv_BTnE[:, :, H + K :].transpose(1, 2)
        # Without a mask: causal for a first chunk; a lone new token after a cache sees all keys.
        is_causal = mask is None and (cache is None or cache.length == 0)
        if cache is not None:
            k_BKTE, v_BKTE = cache.update(layer, k_BKTE, v_BKTE)
        y_BHTE = attention(
            q_BHTE,
            k_BKTE,
            v_BKTE,
            mask=mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.wo(merge_heads(y_BHTE))


class GPTBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = GPTAttention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.d_ff)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); arguments as in `GPTAttention.forward`."""
        x_BTD = x_BTD + self.dropout(self.attn(self.attn_norm(x_BTD), cos, sin, mask, cache, layer))
        return x_BTD + self.dropout(self.mlp(self.mlp_norm(x_BTD)))


class GPTModel(nn.Module):
    """Token embeddings, `n_layers` blocks and the final RMSNorm (no output layer)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) for the embedding and every matrix; the residual output
        projections (`wo`, `w2`) get init_std / sqrt(2 * n_layers) so the residual stream's
        variance does not grow with depth (GPT-2); RMSNorm gains 1."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        for block in self.layers:
            for weight in (block.attn.wo.weight, block.mlp.w2.weight):
                nn.init.normal_(weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states.

        Args:
            input_ids: (B, T) token ids (the new tokens only when `kv_cache` is given).
            attention_mask: (B, S) 1 = real token, 0 = padding, covering cached and new tokens
                (S = cached + T).
            doc_ids: (B, T) document id of every token of packed sequences; attention stays
                within a document and positions restart per document. Not with `kv_cache`.
            position_ids: (B, T) or (T,) explicit RoPE positions, overriding the defaults.
            kv_cache: cache to read and extend (see `GPT.generate`); its length advances by T.

        Returns:
            (B, T, D).
        """
        B, T = input_ids.shape
        past = kv_cache.length if kv_cache is not None else 0
        if doc_ids is not None and kv_cache is not None:
            raise ValueError("doc_ids (packed training batches) cannot be combined with kv_cache")
        if attention_mask is not None and attention_mask.shape != (B, past + T):
            raise ValueError(
                f"attention_mask must have shape (batch, cached + new tokens) = {(B, past + T)}, "
                f"got {tuple(attention_mask.shape)}"
            )
        if position_ids is None:
            if doc_ids is not None:
                position_ids = positions_from_docs(doc_ids)
            elif attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, past:]
            else:
                position_ids = torch.arange(past, past + T, device=input_ids.device)
        mask = build_attention_mask(
            T, past, attention_mask_BS=attention_mask, doc_ids_BT=doc_ids, device=input_ids.device
        )
        x_BTD = self.tok_emb(input_ids)
        cos, sin = rope_cos_sin(
            position_ids, self.config.head_dim, self.config.rope_theta, compute_dtype(x_BTD)
        )
        for i, layer in enumerate(self.layers):
            x_BTD = layer(x_BTD, cos, sin, mask, kv_cache, i)
        if kv_cache is not None:
            kv_cache.length += T
        return self.norm(x_BTD)

    # The backbone interface every family's backbone has (`models.heads.Backbone`).
    def backbone(self) -> GPTModel:
        return self

    @property
    def word_embeddings(self) -> nn.Embedding:
        """The input token embedding table (the output layer shares it when tied)."""
        return self.tok_emb

    def token_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, D) last-layer states (a decoder has no segment ids: `token_type_ids` is
        ignored)."""
        return self(input_ids, attention_mask=attention_mask)

    def sequence_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, D) a decoder's summary of a sequence: the state of its last real token, the only
        one that has read the whole text (padding on either side)."""
        h_BTD = self.token_states(input_ids, attention_mask)
        if attention_mask is None:
            return h_BTD[:, -1]
        rows = torch.arange(h_BTD.shape[0], device=h_BTD.device)
        return h_BTD[rows, last_token_index(attention_mask)]

    def train_own_features(self, trained: bool) -> None:
        """`sequence_features` has no parameters of its own."""


def last_token_index(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row, for left or right padding. (B, T) -> (B,)."""
    T = attention_mask_BT.shape[1]
    positions_BT = torch.arange(T, device=attention_mask_BT.device).expand_as(attention_mask_BT)
    return (positions_BT * attention_mask_BT.bool()).amax(dim=1)


@dataclass
class GPTOutput:
    """What `GPT.forward` returns.

    Attributes:
        logits: (B, T, V), or None when `targets` were given (the fused loss never builds them).
        loss: scalar cross-entropy over non-ignored targets when `targets` were given.
        hidden_states: (B, T, D) final normed hidden states.
    """

    logits: torch.Tensor | None
    loss: torch.Tensor | None
    hidden_states: torch.Tensor


class GPT(nn.Module):
    """Causal language model: `GPTModel` plus an output layer (tied to the embedding by default)."""

    hf_mapping: ClassVar[HFMapping] = LlamaMapping()  # HF LlamaForCausalLM

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GPTModel(config)
        self.lm_head = (
            None
            if config.tie_embeddings
            else nn.Linear(config.d_model, config.vocab_size, bias=False)
        )
        self._init_output()

    def backbone(self) -> GPTModel:
        """The decoder stack without the output layer."""
        return self.model

    @property
    def output_bias(self) -> None:
        """None: the output layer has no bias (the Llama layout)."""
        return None

    @property
    def output_weight(self) -> torch.Tensor:
        """(V, D) weight of the output layer (the token embedding when tied)."""
        return self.model.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialize everything: `GPTModel.init_weights`, and Normal(0, init_std) for an
        untied output layer (called by the constructor; call again after materializing a model
        built on the meta device)."""
        self.model.init_weights()
        self._init_output()

    @torch.no_grad()
    def _init_output(self) -> None:
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=self.config.init_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        targets: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> GPTOutput:
        """Logits, or the training loss.

        Args:
            input_ids: (B, T) token ids.
            targets: (B, T) next-token ids aligned with `input_ids` (already shifted), with
                `ignore_index` where no loss is wanted. When given, the loss is computed by the
                fused chunked output layer and `logits` is None.
            attention_mask, doc_ids, position_ids, kv_cache: see `GPTModel.forward`.
            ignore_index: target value excluded from the loss.
            reduction: "mean" over counted targets or "sum" (for token-count normalization
                across gradient-accumulation steps).

        Returns:
            `GPTOutput`.
        """
        h_BTD = self.model(
            input_ids,
            attention_mask=attention_mask,
            doc_ids=doc_ids,
            position_ids=position_ids,
            kv_cache=kv_cache,
        )
        if targets is None:
            return GPTOutput(
                logits=F.linear(h_BTD, self.output_weight), loss=None, hidden_states=h_BTD
            )
        loss = linear_cross_entropy(
            h_BTD.flatten(0, 1),
            self.output_weight,
            targets.flatten(),
            ignore_index=ignore_index,
            reduction=reduction,
        )
        return GPTOutput(logits=None, loss=loss, hidden_states=h_BTD)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor | Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        attention_mask: torch.Tensor | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Continue a batch of prompts.

        Prompts of different lengths are given either as a list of token lists, or as a (B, T)
        tensor with an `attention_mask` marking padding on either side. They are re-aligned to
        the right (left padding) internally, with positions counting real tokens only, so each
        row continues exactly as it would alone.

        Args:
            prompt_ids: (B, T) tensor, or a sequence of B token-id sequences (ragged).
            max_new_tokens: tokens to generate per row (at most).
            temperature: softmax temperature; 0 means greedy (argmax).
            top_k: sample only among the k most likely tokens.
            top_p: nucleus sampling: the smallest set of tokens whose probability reaches p.
            eos_id: a row stops after emitting it; later slots of that row hold `eos_id`.
                Generation ends early once every row has stopped.
            attention_mask: (B, T) 1 = real token for a tensor `prompt_ids`; no padding if None.
            seed: seeds a private generator, for reproducible sampling.
            generator: a generator to sample from (overrides `seed`).
            use_cache: decode with a KV cache (True) or re-run the full sequence every step.

        Returns:
            (B, N) new token ids, N <= max_new_tokens.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        device = self.output_weight.device
        ids_BT, mask_BT = _left_align(prompt_ids, attention_mask, device)
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        was_training = self.training
        self.eval()  # dropout off while decoding, whatever mode the caller left us in
        try:
            sampling = (temperature, top_k, top_p, generator)
            return self._decode(ids_BT, mask_BT, max_new_tokens, sampling, eos_id, use_cache)
        finally:
            self.train(was_training)

    def _decode(
        self,
        ids_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        max_new_tokens: int,
        sampling: tuple[float, int | None, float | None, torch.Generator | None],
        eos_id: int | None,
        use_cache: bool,
    ) -> torch.Tensor:
        """The decoding loop of `generate` on left-aligned prompts; returns (B, N)."""
        B, T = ids_BT.shape
        padded = not bool(mask_BT.all())  # without padding, plain causal attention suffices
        cache = None
        if use_cache:
            # Autocast dtype when generating under autocast, so cached keys match new queries.
            dtype = compute_dtype(self.output_weight)
            cache = KVCache(self.config, B, T + max_new_tokens, device=ids_BT.device, dtype=dtype)
        done_B = torch.zeros(B, dtype=torch.bool, device=ids_BT.device)
        new_tokens: list[torch.Tensor] = []
        step_ids = ids_BT
        for _ in range(max_new_tokens):
            h_BTD = self.model(
                step_ids if use_cache else ids_BT,
                attention_mask=mask_BT if padded else None,
                kv_cache=cache,
            )
            logits_BV = F.linear(h_BTD[:, -1], self.output_weight).float()
            next_B = _sample(logits_BV, *sampling)
            if eos_id is not None:
                next_B = torch.where(done_B, eos_id, next_B)
                done_B |= next_B == eos_id
            new_tokens.append(next_B)
            if eos_id is not None and bool(done_B.all()):
                break
            step_ids = next_B[:, None]
            ids_BT = torch.cat([ids_BT, step_ids], dim=1)
            mask_BT = torch.cat([mask_BT, torch.ones_like(step_ids, dtype=mask_BT.dtype)], dim=1)
        return torch.stack(new_tokens, dim=1)
