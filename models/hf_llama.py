"""GPT's Hugging Face mapping: our `GPT` (Llama-style) is HF `LlamaForCausalLM` (see
`models/hf_mapping.py` for the contract and `models/hf.py` for the import and export that use
it). Our fused projections split back into Llama's: `wqkv` into q, k, v (k and v with the
key/value heads of GQA), `w13` into the SwiGLU gate and up."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from models.config import GPTConfig
from models.hf_mapping import HFMapping, Spec, UnsupportedCheckpointError, check_tied, require

__all__ = ["LlamaMapping", "gpt_config_from_hf", "llama_hf_config"]


class LlamaMapping(HFMapping):
    """HF `LlamaForCausalLM`: the decoder under `model.`, an untied output layer `lm_head`."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    special_tokens: Mapping[str, tuple[str, ...]] = {
        "bos_token": ("<|begin_of_text|>", "<s>", "<|endoftext|>"),
        "eos_token": ("<|end_of_text|>", "</s>", "<|endoftext|>"),
        "pad_token": ("<|pad|>", "<pad>"),
        "unk_token": ("<unk>",),
    }
    writes_special_token_ids = True

    def config_from_hf(self, hf_config: Mapping[str, Any]) -> GPTConfig:
        return gpt_config_from_hf(hf_config)

    def hf_config(self, config: GPTConfig) -> dict[str, Any]:
        return llama_hf_config(config)

    def spec(self, config: GPTConfig) -> Spec:
        spec: Spec = [("model.tok_emb.weight", ["model.embed_tokens.weight"])]
        for i in range(config.n_layers):
            ours, hf = f"model.layers.{i}", f"model.layers.{i}"
            qkv = [f"{hf}.self_attn.{n}_proj.weight" for n in ("q", "k", "v")]
            gate_up = [f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"]
            spec += [
                (f"{ours}.attn.wqkv.weight", qkv),
                (f"{ours}.attn.wo.weight", [f"{hf}.self_attn.o_proj.weight"]),
                (f"{ours}.mlp.w13.weight", gate_up),
                (f"{ours}.mlp.w2.weight", [f"{hf}.mlp.down_proj.weight"]),
                (f"{ours}.attn_norm.weight", [f"{hf}.input_layernorm.weight"]),
                (f"{ours}.mlp_norm.weight", [f"{hf}.post_attention_layernorm.weight"]),
            ]
        spec.append(("model.norm.weight", ["model.norm.weight"]))
        if not config.tie_embeddings:
            spec.append(("lm_head.weight", ["lm_head.weight"]))
        return spec

    def imported_state(
        self, state: dict[str, torch.Tensor], config: GPTConfig
    ) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
        if not config.tie_embeddings:
            return state, ("rotary_emb.inv_freq",)
        check_tied(state, "lm_head.weight", "model.embed_tokens.weight")
        return state, ("rotary_emb.inv_freq", "lm_head.weight")

    def split_sizes(self, ours: str, parts: int, rows: int, config: GPTConfig) -> list[int]:
        if ours.endswith("wqkv.weight"):  # H query heads, K key and K value heads
            kv = config.n_kv_heads * config.head_dim
            return [config.n_heads * config.head_dim, kv, kv]
        return super().split_sizes(ours, parts, rows, config)  # w13 of SwiGLU


def gpt_config_from_hf(config: Mapping[str, Any]) -> GPTConfig:
    """Our `GPTConfig` from an HF Llama `config.json` dict."""
    require(config, "hidden_act", ("silu",), "silu")
    require(config, "attention_bias", (False,), False)
    require(config, "mlp_bias", (False,), False)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedCheckpointError(
            f"RoPE type {rope_type!r} is not supported; only the default (unscaled) RoPE is"
        )
    n_heads, d_model = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or d_model // n_heads
    if head_dim * n_heads != d_model:
        raise UnsupportedCheckpointError(
            f"head_dim={head_dim} x num_attention_heads={n_heads} != hidden_size={d_model}; "
            "only head_dim = hidden_size / heads is supported"
        )
    return GPTConfig(
        vocab_size=config["vocab_size"],
        n_layers=config["num_hidden_layers"],
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        d_ff=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        dropout=float(config.get("attention_dropout", 0.0)),
        init_std=config.get("initializer_range", 0.02),
    )


def llama_hf_config(config: GPTConfig) -> dict[str, Any]:
    """The `transformers` LlamaConfig fields of `config`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        # transformers >= 5 reads rope_parameters, 4.x reads rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": config.dropout,
        "mlp_bias": False,
        "initializer_range": config.init_std,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
