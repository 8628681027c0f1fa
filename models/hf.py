"""Hugging Face interop: import `BertForPreTraining` / `BertModel` / `LlamaForCausalLM`
checkpoints into our modules and export ours as directories `transformers` loads.

No `transformers` import: `config.json` is read and written as JSON and weights go through
safetensors (or `torch.load(weights_only=True)` for legacy `pytorch_model.bin`). A source is a
checkpoint directory or an in-memory HF model object (anything with `.config.to_dict()` and
`.state_dict()`).

The weight mapping for each family is one table of (our name, HF names); fused parameters list
several HF names, concatenated along dim 0 on import and split back on export, so both directions
share the same code. Imported weights are cast to our modules' dtype (float32 by default; cast
the model afterwards for bf16 inference).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.atomic_folder import write_folder
from models.bert import BertConfig, BertForPreTraining, BertModel
from models.gpt import GPT, GPTConfig

__all__ = [
    "UnsupportedCheckpointError",
    "bert_hf_config",
    "export_hf",
    "llama_hf_config",
    "load_hf",
    "load_hf_bert",
    "load_hf_gpt",
    "write_hf_export",
]

log = logging.getLogger(__name__)

BERT_ARCHITECTURES = ("BertForPreTraining", "BertModel")
LLAMA_ARCHITECTURES = ("LlamaForCausalLM",)

# (our parameter name, HF parameter names concatenated along dim 0 to form it)
Spec = list[tuple[str, list[str]]]


class UnsupportedCheckpointError(ValueError):
    """The checkpoint's architecture, options or weights do not match what we can represent."""


class SavesTokenizer(Protocol):
    """A `tokenizers.Tokenizer`-like object."""

    def to_str(self, pretty: bool = False) -> str: ...


# ----------------------------------------------------------------------------------------------
# Reading a source


def _read_source(source: str | Path | Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state dict) from a checkpoint directory or an HF model object."""
    if not isinstance(source, str | Path):
        if not (hasattr(source, "config") and hasattr(source, "state_dict")):
            raise TypeError(
                f"expected a checkpoint directory or a transformers model, got {type(source)}"
            )
        config = source.config.to_dict()
        # A freshly built model has no `architectures` yet; its class says what it is.
        config["architectures"] = [type(source).__name__]
        return config, dict(source.state_dict())
    directory = Path(source)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found; is {directory} an HF checkpoint?")
    config = json.loads(config_path.read_text())
    return config, _read_weights(directory)


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    for index_name, loader in (
        ("model.safetensors.index.json", load_file),
        ("pytorch_model.bin.index.json", _torch_load),
    ):
        index = directory / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(loader(directory / shard))
            return state
    if (directory / "model.safetensors").is_file():
        return load_file(directory / "model.safetensors")
    if (directory / "pytorch_model.bin").is_file():
        return _torch_load(directory / "pytorch_model.bin")
    raise FileNotFoundError(
        f"no model.safetensors, pytorch_model.bin or sharded index in {directory}"
    )


def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    # weights_only: a checkpoint from the internet must not be able to run code.
    return torch.load(path, map_location="cpu", weights_only=True)


def _architecture(config: Mapping[str, Any], supported: tuple[str, ...]) -> str:
    architectures = config.get("architectures") or []
    for name in architectures:
        if name in supported:
            return name
    raise UnsupportedCheckpointError(
        f"unsupported architecture {architectures or config.get('model_type')!r}; "
        f"supported: {', '.join(supported)}"
    )


def _require(config: Mapping[str, Any], key: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = config.get(key, default)
    if value not in allowed:
        raise UnsupportedCheckpointError(
            f"config.json has {key}={value!r}; only {' or '.join(map(repr, allowed))} is supported"
        )


# ----------------------------------------------------------------------------------------------
# Mapping tables


def _bert_spec(config: BertConfig, with_heads: bool) -> Spec:
    """Our BertForPreTraining (or BertModel) names -> HF names (with the `bert.` prefix)."""
    spec: Spec = [
        ("embeddings.word.weight", ["embeddings.word_embeddings.weight"]),
        ("embeddings.position.weight", ["embeddings.position_embeddings.weight"]),
        ("embeddings.token_type.weight", ["embeddings.token_type_embeddings.weight"]),
    ]
    spec += _pairs("embeddings.norm", "embeddings.LayerNorm")
    for i in range(config.n_layers):
        ours, hf = f"layers.{i}", f"encoder.layer.{i}"
        for p in ("weight", "bias"):
            qkv = [f"{hf}.attention.self.{n}.{p}" for n in ("query", "key", "value")]
            spec.append((f"{ours}.qkv.{p}", qkv))
        spec += _pairs(f"{ours}.attn_out", f"{hf}.attention.output.dense")
        spec += _pairs(f"{ours}.attn_norm", f"{hf}.attention.output.LayerNorm")
        spec += _pairs(f"{ours}.ff_in", f"{hf}.intermediate.dense")
        spec += _pairs(f"{ours}.ff_out", f"{hf}.output.dense")
        spec += _pairs(f"{ours}.ff_norm", f"{hf}.output.LayerNorm")
    spec += _pairs("pooler", "pooler.dense")
    if not with_heads:
        return spec
    spec = [(f"bert.{ours}", [f"bert.{n}" for n in hf]) for ours, hf in spec]
    spec += _pairs("mlm_dense", "cls.predictions.transform.dense")
    spec += _pairs("mlm_norm", "cls.predictions.transform.LayerNorm")
    spec += [("mlm_bias", ["cls.predictions.bias"])]
    spec += _pairs("nsp", "cls.seq_relationship")
    return spec


def _llama_spec(config: GPTConfig) -> Spec:
    spec: Spec = [("model.tok_emb.weight", ["model.embed_tokens.weight"])]
    for i in range(config.n_layers):
        ours, hf = f"model.layers.{i}", f"model.layers.{i}"
        qkv = [f"{hf}.self_attn.{n}_proj.weight" for n in ("q", "k", "v")]
        spec += [
            (f"{ours}.attn.wqkv.weight", qkv),
            (f"{ours}.attn.wo.weight", [f"{hf}.self_attn.o_proj.weight"]),
            (f"{ours}.mlp.w13.weight", [f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"]),
            (f"{ours}.mlp.w2.weight", [f"{hf}.mlp.down_proj.weight"]),
            (f"{ours}.attn_norm.weight", [f"{hf}.input_layernorm.weight"]),
            (f"{ours}.mlp_norm.weight", [f"{hf}.post_attention_layernorm.weight"]),
        ]
    spec.append(("model.norm.weight", ["model.norm.weight"]))
    if not config.tie_embeddings:
        spec.append(("lm_head.weight", ["lm_head.weight"]))
    return spec


def _pairs(ours: str, hf: str) -> Spec:
    return [(f"{ours}.{p}", [f"{hf}.{p}"]) for p in ("weight", "bias")]


def _split_sizes(spec_entry: tuple[str, list[str]], model: nn.Module) -> list[int]:
    """Rows of each HF tensor inside our (possibly fused) parameter."""
    ours, hf_names = spec_entry
    rows = model.get_parameter(ours).shape[0]
    if len(hf_names) == 1:
        return [rows]
    if ours.endswith("wqkv.weight"):
        c = model.config
        return [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
    return [rows // len(hf_names)] * len(hf_names)  # qkv of BERT, w13 of SwiGLU


# ----------------------------------------------------------------------------------------------
# Import


def _load_state(
    model: nn.Module, spec: Spec, hf_state: dict[str, torch.Tensor], ignorable: tuple[str, ...]
) -> None:
    """Copy HF tensors into `model` per `spec`; error on missing, unexpected or misshapen keys."""
    needed = {name for _, hf_names in spec for name in hf_names}
    missing = sorted(needed - hf_state.keys())
    unexpected = sorted(
        k for k in hf_state.keys() - needed if not any(k.endswith(s) for s in ignorable)
    )
    if missing or unexpected:
        raise UnsupportedCheckpointError(
            "checkpoint weights do not match the architecture in config.json: "
            f"missing {missing[:10]}{' ...' if len(missing) > 10 else ''}, "
            f"unexpected {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
        )
    with torch.no_grad():
        for ours, hf_names in spec:
            value = torch.cat([hf_state[n] for n in hf_names], dim=0)
            param = model.get_parameter(ours)
            if value.shape != param.shape:
                raise UnsupportedCheckpointError(
                    f"{' + '.join(hf_names)} has shape {tuple(value.shape)}, expected "
                    f"{tuple(param.shape)} for {ours}"
                )
            param.copy_(value)


def _check_tied(hf_state: dict[str, torch.Tensor], copy: str, original: str) -> None:
    """A saved copy of a tied weight must equal the weight it is tied to."""
    if (
        copy in hf_state
        and original in hf_state
        and not torch.equal(hf_state[copy], hf_state[original])
    ):
        raise UnsupportedCheckpointError(
            f"{copy} differs from {original}; untied weights are not supported here"
        )


def _normalize_bert_keys(
    state: dict[str, torch.Tensor], with_heads: bool
) -> dict[str, torch.Tensor]:
    """Old TF-converted names (LayerNorm.gamma/beta) and prefix-less BertModel checkpoints."""
    out = {}
    for key, value in state.items():
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias"
        )
        if with_heads and not key.startswith(("bert.", "cls.")):
            key = f"bert.{key}"
        if not with_heads and key.startswith("bert."):
            key = key[len("bert.") :]
        out[key] = value
    return out


def bert_config_from_hf(config: Mapping[str, Any]) -> BertConfig:
    """Our `BertConfig` from an HF BERT `config.json` dict."""
    _require(config, "hidden_act", ("gelu",), "gelu")
    _require(config, "position_embedding_type", ("absolute",), "absolute")
    _require(config, "is_decoder", (False,), False)
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


def load_hf_bert(source: str | Path | Any) -> BertForPreTraining | BertModel:
    """Our BERT from an HF `BertForPreTraining` (-> `BertForPreTraining`) or `BertModel`
    (-> `BertModel`) directory or object."""
    return _bert_from_hf(*_read_source(source))


def _bert_from_hf(
    hf_config: dict[str, Any], state: dict[str, torch.Tensor]
) -> BertForPreTraining | BertModel:
    architecture = _architecture(hf_config, BERT_ARCHITECTURES)
    config = bert_config_from_hf(hf_config)
    with_heads = architecture == "BertForPreTraining"
    state = _normalize_bert_keys(state, with_heads)
    model = BertForPreTraining(config) if with_heads else BertModel(config)
    if with_heads:
        _check_tied(
            state, "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"
        )
        if "cls.predictions.bias" not in state and "cls.predictions.decoder.bias" in state:
            state["cls.predictions.bias"] = state["cls.predictions.decoder.bias"]
        _check_tied(state, "cls.predictions.decoder.bias", "cls.predictions.bias")
    ignorable = ("position_ids", "token_type_ids", "decoder.weight", "decoder.bias")
    _load_state(model, _bert_spec(config, with_heads), state, ignorable)
    return model


def gpt_config_from_hf(config: Mapping[str, Any]) -> GPTConfig:
    """Our `GPTConfig` from an HF Llama `config.json` dict."""
    _require(config, "hidden_act", ("silu",), "silu")
    _require(config, "attention_bias", (False,), False)
    _require(config, "mlp_bias", (False,), False)
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


def load_hf_gpt(source: str | Path | Any) -> GPT:
    """Our GPT from an HF `LlamaForCausalLM` directory or object."""
    return _gpt_from_hf(*_read_source(source))


def _gpt_from_hf(hf_config: dict[str, Any], state: dict[str, torch.Tensor]) -> GPT:
    _architecture(hf_config, LLAMA_ARCHITECTURES)
    config = gpt_config_from_hf(hf_config)
    model = GPT(config)
    ignorable = ("rotary_emb.inv_freq",)
    if config.tie_embeddings:
        _check_tied(state, "lm_head.weight", "model.embed_tokens.weight")
        ignorable += ("lm_head.weight",)
    _load_state(model, _llama_spec(config), state, ignorable)
    return model


def load_hf(source: str | Path | Any) -> BertForPreTraining | BertModel | GPT:
    """Import any supported HF checkpoint, dispatching on `architectures` in its config."""
    hf_config, state = _read_source(source)
    architectures = hf_config.get("architectures") or []
    if any(a in BERT_ARCHITECTURES for a in architectures):
        return _bert_from_hf(hf_config, state)
    if any(a in LLAMA_ARCHITECTURES for a in architectures):
        return _gpt_from_hf(hf_config, state)
    raise UnsupportedCheckpointError(
        f"unsupported architecture {architectures or hf_config.get('model_type')!r}; "
        f"supported: {', '.join(BERT_ARCHITECTURES + LLAMA_ARCHITECTURES)}"
    )


# ----------------------------------------------------------------------------------------------
# Export


def bert_hf_config(config: BertConfig, architecture: str) -> dict[str, Any]:
    """The `transformers` BertConfig fields of `config` (also used by bench/ to build the
    reference model)."""
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


def export_hf(
    model: BertForPreTraining | BertModel | GPT,
    directory: str | Path,
    *,
    tokenizer: SavesTokenizer | None = None,
    special_tokens: Mapping[str, str] | None = None,
) -> Path:
    """Write `config.json` + `model.safetensors` (+ tokenizer files) loadable by `transformers`.

    BERT loads with `AutoModelForPreTraining` (or `AutoModel` for a `BertModel`), GPT with
    `AutoModelForCausalLM`. Tied weights are stored once, as `save_pretrained` does.

    The export replaces `directory` whole (models/atomic_folder.py): a kill mid-export leaves
    the previous export as it was, never a mix of old and new files.

    Args:
        model: our model, in any dtype (weights are written as they are).
        directory: created if needed; files of the same names are replaced, others kept.
        tokenizer: a `tokenizers.Tokenizer` (anything with `.to_str(pretty)`); writes
            `tokenizer.json` and a `tokenizer_config.json` for `AutoTokenizer`.
        special_tokens: HF names to tokens, e.g. {"cls_token": "[CLS]", "eos_token": "</s>"};
            by default the usual BERT / GPT tokens found in the tokenizer's vocabulary.

    Returns:
        The directory.
    """
    write_hf_export(model, directory, tokenizer=tokenizer, special_tokens=special_tokens)
    return Path(directory)


def write_hf_export(
    model: BertForPreTraining | BertModel | GPT,
    directory: str | Path,
    *,
    tokenizer: SavesTokenizer | None = None,
    special_tokens: Mapping[str, str] | None = None,
) -> bool:
    """`export_hf`, returning whether `directory` changed (False: it held this very export
    already, found without writing anything, and is left untouched; a re-export of a
    finished run says which).

    Raises:
        OSError: the export could not be written (ENOSPC: a full disk); `directory` is as it was.
    """
    if isinstance(model, GPT):
        hf_config, spec = llama_hf_config(model.config), _llama_spec(model.config)
    elif isinstance(model, BertForPreTraining | BertModel):
        with_heads = isinstance(model, BertForPreTraining)
        architecture = "BertForPreTraining" if with_heads else "BertModel"
        hf_config = bert_hf_config(model.config, architecture)
        spec = _bert_spec(model.config, with_heads)
    else:
        raise TypeError(f"cannot export {type(model).__name__}; expected BERT or GPT")
    tensors: dict[str, torch.Tensor] = {}
    for entry in spec:
        value = model.get_parameter(entry[0]).detach().cpu()
        for name, part in zip(entry[1], value.split(_split_sizes(entry, model)), strict=True):
            # Split views share storage, which safetensors refuses: store each as its own copy.
            tensors[name] = part.contiguous().clone()
    hf_config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    files: dict[str, bytes] = {}
    if tokenizer is not None:
        files = _tokenizer_files(tokenizer, special_tokens, model, hf_config)
    files["config.json"] = (json.dumps(hf_config, indent=2, sort_keys=True) + "\n").encode()
    return write_folder(directory, files, {"model.safetensors": tensors}, save=save_file)


_DEFAULT_SPECIAL_TOKENS = {
    "bert": {
        "unk_token": ["[UNK]"],
        "cls_token": ["[CLS]"],
        "sep_token": ["[SEP]"],
        "pad_token": ["[PAD]"],
        "mask_token": ["[MASK]"],
    },
    "llama": {
        "bos_token": ["<|begin_of_text|>", "<s>", "<|endoftext|>"],
        "eos_token": ["<|end_of_text|>", "</s>", "<|endoftext|>"],
        "pad_token": ["<|pad|>", "<pad>"],
        "unk_token": ["<unk>"],
    },
}


def _tokenizer_files(
    tokenizer: SavesTokenizer,
    special_tokens: Mapping[str, str] | None,
    model: nn.Module,
    hf_config: dict[str, Any],
) -> dict[str, bytes]:
    """The tokenizer's files of an export (name -> bytes, as `Tokenizer.save` writes them);
    sets the special tokens' ids in `hf_config`."""
    family = hf_config["model_type"]
    if special_tokens is None:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        special_tokens = {
            role: next(c for c in candidates if c in vocab)
            for role, candidates in _DEFAULT_SPECIAL_TOKENS[family].items()
            if any(c in vocab for c in candidates)
        }
    token_to_id = getattr(tokenizer, "token_to_id", None)
    if family == "llama" and token_to_id is not None:
        # Let `generate` and pipelines in transformers find the ids.
        for role in ("bos", "eos", "pad"):
            if f"{role}_token" in special_tokens:
                hf_config[f"{role}_token_id"] = token_to_id(special_tokens[f"{role}_token"])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model.config.max_seq_len,
        "clean_up_tokenization_spaces": False,
        **special_tokens,
    }
    if family == "bert":
        tokenizer_config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    log.info("export's tokenizer has special tokens %s", dict(special_tokens))
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True).encode(),
        "tokenizer_config.json": (json.dumps(tokenizer_config, indent=2) + "\n").encode(),
        "special_tokens_map.json": json.dumps(dict(special_tokens), indent=2).encode(),
    }
