"""BERT's Hugging Face mapping: our `BertForPreTraining` is HF `BertForPreTraining` and our
`BertModel` HF `BertModel` (the same names, module for module; see `models/hf_mapping.py` for
the contract and `models/hf.py` for the import and export that use it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from models.config import BertConfig
from models.hf_mapping import (
    HFMapping,
    Spec,
    UnsupportedCheckpointError,
    check_tied,
    pairs,
    require,
)

__all__ = ["BertMapping", "bert_config_from_hf", "bert_hf_config", "bert_refusal"]


class BertMapping(HFMapping):
    """HF `BertForPreTraining` (`with_heads`: the encoder under `bert.`, the MLM and NSP heads
    under `cls.`) or `BertModel` (the encoder alone, unprefixed)."""

    model_type = "bert"
    special_tokens: Mapping[str, tuple[str, ...]] = {
        "unk_token": ("[UNK]",),
        "cls_token": ("[CLS]",),
        "sep_token": ("[SEP]",),
        "pad_token": ("[PAD]",),
        "mask_token": ("[MASK]",),
    }
    model_input_names = ("input_ids", "token_type_ids", "attention_mask")

    def __init__(self, *, with_heads: bool) -> None:
        self.with_heads = with_heads
        self.architecture = "BertForPreTraining" if with_heads else "BertModel"

    def config_from_hf(self, hf_config: Mapping[str, Any]) -> BertConfig:
        return bert_config_from_hf(hf_config)

    def hf_config(self, config: BertConfig) -> dict[str, Any]:
        return bert_hf_config(config, self.architecture)

    def refusal(self, config: BertConfig) -> str | None:
        return bert_refusal(config)

    def spec(self, config: BertConfig) -> Spec:
        """Our BertForPreTraining (or BertModel) names -> HF names (with the `bert.` prefix)."""
        spec: Spec = [
            ("embeddings.word.weight", ["embeddings.word_embeddings.weight"]),
            ("embeddings.position.weight", ["embeddings.position_embeddings.weight"]),
            ("embeddings.token_type.weight", ["embeddings.token_type_embeddings.weight"]),
        ]
        spec += pairs("embeddings.norm", "embeddings.LayerNorm")
        for i in range(config.n_layers):
            ours, hf = f"layers.{i}", f"encoder.layer.{i}"
            for p in ("weight", "bias"):
                qkv = [f"{hf}.attention.self.{n}.{p}" for n in ("query", "key", "value")]
                spec.append((f"{ours}.qkv.{p}", qkv))
            spec += pairs(f"{ours}.attn_out", f"{hf}.attention.output.dense")
            spec += pairs(f"{ours}.attn_norm", f"{hf}.attention.output.LayerNorm")
            spec += pairs(f"{ours}.ff_in", f"{hf}.intermediate.dense")
            spec += pairs(f"{ours}.ff_out", f"{hf}.output.dense")
            spec += pairs(f"{ours}.ff_norm", f"{hf}.output.LayerNorm")
        spec += pairs("pooler", "pooler.dense")
        if not self.with_heads:
            return spec
        spec = [(f"bert.{ours}", [f"bert.{n}" for n in hf]) for ours, hf in spec]
        spec += pairs("mlm_dense", "cls.predictions.transform.dense")
        spec += pairs("mlm_norm", "cls.predictions.transform.LayerNorm")
        spec += [("mlm_bias", ["cls.predictions.bias"])]
        spec += pairs("nsp", "cls.seq_relationship")
        return spec

    def imported_state(
        self, state: dict[str, torch.Tensor], config: BertConfig
    ) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
        state = self._normalized_keys(state)
        if self.with_heads:
            check_tied(
                state, "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"
            )
            if "cls.predictions.bias" not in state and "cls.predictions.decoder.bias" in state:
                state["cls.predictions.bias"] = state["cls.predictions.decoder.bias"]
            check_tied(state, "cls.predictions.decoder.bias", "cls.predictions.bias")
        return state, ("position_ids", "token_type_ids", "decoder.weight", "decoder.bias")

    def _normalized_keys(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Old TF-converted names (LayerNorm.gamma/beta) and prefix-less BertModel checkpoints."""
        out = {}
        for key, value in state.items():
            key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias"
            )
            if self.with_heads and not key.startswith(("bert.", "cls.")):
                key = f"bert.{key}"
            if not self.with_heads and key.startswith("bert."):
                key = key[len("bert.") :]
            out[key] = value
        return out


def bert_config_from_hf(config: Mapping[str, Any]) -> BertConfig:
    """Our `BertConfig` from an HF BERT `config.json` dict."""
    require(config, "hidden_act", ("gelu",), "gelu")
    require(config, "position_embedding_type", ("absolute",), "absolute")
    require(config, "is_decoder", (False,), False)
    return BertConfig(
        vocab_size=config["vocab_size"],
        n_layers=config["num_hidden_layers"],
        d_model=config["hidden_size"],
        n_heads=config["num_attention_heads"],
        d_ff=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 512),
        type_vocab_size=config.get("type_vocab_size", 2),
        dropout=config.get("hidden_dropout_prob", 0.1),
        attn_dropout=config.get("attention_probs_dropout_prob", 0.1),
        layer_norm_eps=config.get("layer_norm_eps", 1e-12),
        init_std=config.get("initializer_range", 0.02),
        pad_token_id=config.get("pad_token_id") or 0,
    )


def bert_refusal(config: BertConfig) -> str | None:
    """Why HF BERT cannot hold a model of `config` (rotary positions, pre-norm blocks), or
    None for the original architecture."""
    options = config.unlike_original()
    if not options:
        return None
    return (
        f"HF BertModel has learned absolute positions and post-LN blocks, not "
        f"{' and '.join(options)}; the checkpoint holds the model (load it with "
        "pipeline.checkpoint.load_pretrained or use it with make finetune / make glue)"
    )


def bert_hf_config(config: BertConfig, architecture: str) -> dict[str, Any]:
    """The `transformers` BertConfig fields of `config` (also used by bench/ to build the
    reference model).

    Raises:
        UnsupportedCheckpointError: HF BERT has no such architecture (`bert_refusal`).
    """
    refusal = bert_refusal(config)
    if refusal is not None:
        raise UnsupportedCheckpointError(refusal)
    return {
        "architectures": [architecture],
        "model_type": "bert",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "intermediate_size": config.d_ff,
        "hidden_act": "gelu",
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.attn_dropout,
        "max_position_embeddings": config.max_seq_len,
        "type_vocab_size": config.type_vocab_size,
        "initializer_range": config.init_std,
        "layer_norm_eps": config.layer_norm_eps,
        "pad_token_id": config.pad_token_id,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
    }
