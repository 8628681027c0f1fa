"""Hugging Face interop: import `BertForPreTraining` / `BertModel` / `LlamaForCausalLM`
checkpoints into our modules and export ours as directories `transformers` loads.

No `transformers` import: `config.json` is read and written as JSON and weights go through
safetensors (or `torch.load(weights_only=True)` for legacy `pytorch_model.bin`). A source is a
checkpoint directory or an in-memory HF model object (anything with `.config.to_dict()` and
`.state_dict()`).

What differs between families is the model class's `hf_mapping` (`models/hf_mapping.py`: the
architecture, `config.json` fields, weight table, special tokens; `models/hf_bert.py` and
`models/hf_llama.py`); this module reads, copies and writes for any class that names one.
Imported weights are cast to our modules' dtype (float32 by default; cast the model afterwards
for bf16 inference).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.atomic_folder import write_folder
from models.bert import BertForPreTraining, BertModel
from models.gpt import GPT
from models.hf_mapping import HFMapping, Spec, UnsupportedCheckpointError

__all__ = [
    "HF_MODELS",
    "UnsupportedCheckpointError",
    "export_hf",
    "export_refusal",
    "load_hf",
    "load_hf_bert",
    "load_hf_gpt",
    "write_hf_export",
]

log = logging.getLogger(__name__)

# The model classes `load_hf` builds by default, each named by its mapping's architecture (the
# pipeline passes its registered families' classes instead).
HF_MODELS: tuple[type[nn.Module], ...] = (BertForPreTraining, BertModel, GPT)


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


def _mapping(model_class: type[nn.Module]) -> HFMapping | None:
    return getattr(model_class, "hf_mapping", None)


def _model_class(
    hf_config: Mapping[str, Any], model_classes: Iterable[type[nn.Module]]
) -> type[nn.Module]:
    """The first of `model_classes` whose mapping reads an architecture that `config.json`
    names."""
    by_architecture = {m.architecture: c for c in model_classes if (m := _mapping(c)) is not None}
    architectures = hf_config.get("architectures") or []
    for name in architectures:
        if name in by_architecture:
            return by_architecture[name]
    raise UnsupportedCheckpointError(
        f"unsupported architecture {architectures or hf_config.get('model_type')!r}; "
        f"supported: {', '.join(by_architecture)}"
    )


def _from_hf(
    hf_config: dict[str, Any],
    state: dict[str, torch.Tensor],
    model_classes: Iterable[type[nn.Module]],
) -> nn.Module:
    model_class = _model_class(hf_config, model_classes)
    mapping = model_class.hf_mapping
    config = mapping.config_from_hf(hf_config)
    model = model_class(config)
    state, ignorable = mapping.imported_state(state, config)
    _load_state(model, mapping.spec(config), state, ignorable)
    return model


def load_hf(
    source: str | Path | Any, model_classes: Iterable[type[nn.Module]] = HF_MODELS
) -> nn.Module:
    """Import any supported HF checkpoint as the one of `model_classes` (default: our BERT
    with and without heads, and GPT) whose `hf_mapping` reads the `architectures` in its
    config."""
    return _from_hf(*_read_source(source), model_classes)


def load_hf_bert(source: str | Path | Any) -> BertForPreTraining | BertModel:
    """Our BERT from an HF `BertForPreTraining` (-> `BertForPreTraining`) or `BertModel`
    (-> `BertModel`) directory or object."""
    return _from_hf(*_read_source(source), (BertForPreTraining, BertModel))


def load_hf_gpt(source: str | Path | Any) -> GPT:
    """Our GPT from an HF `LlamaForCausalLM` directory or object."""
    return _from_hf(*_read_source(source), (GPT,))


# ----------------------------------------------------------------------------------------------
# Export


def export_hf(
    model: nn.Module,
    directory: str | Path,
    *,
    tokenizer: SavesTokenizer | None = None,
    special_tokens: Mapping[str, str] | None = None,
) -> Path:
    """Write `config.json` + `model.safetensors` (+ tokenizer files) loadable by `transformers`,
    for a model whose class names its `hf_mapping`.

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


def export_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot be exported (its class names no HF mapping, or its config has an
    option the HF architecture lacks), or None when `export_hf` can write it."""
    mapping = _mapping(type(model))
    if mapping is None:
        return (
            "its class names no HF mapping; export a model whose class has an `hf_mapping` "
            "(models/hf_mapping.py), such as BERT or GPT"
        )
    return mapping.refusal(model.config)


def write_hf_export(
    model: nn.Module,
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
    mapping = _mapping(type(model))
    refusal = export_refusal(model)
    if refusal is not None:
        error = TypeError if mapping is None else UnsupportedCheckpointError
        raise error(f"cannot export {type(model).__name__}: {refusal}")
    hf_config = mapping.hf_config(model.config)
    tensors: dict[str, torch.Tensor] = {}
    for ours, hf_names in mapping.spec(model.config):
        value = model.get_parameter(ours).detach().cpu()
        rows, parts = value.shape[0], len(hf_names)
        sizes = [rows] if parts == 1 else mapping.split_sizes(ours, parts, rows, model.config)
        for name, part in zip(hf_names, value.split(sizes), strict=True):
            # Split views share storage, which safetensors refuses: store each as its own copy.
            tensors[name] = part.contiguous().clone()
    hf_config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    files: dict[str, bytes] = {}
    if tokenizer is not None:
        files = _tokenizer_files(tokenizer, special_tokens, model, mapping, hf_config)
    files["config.json"] = (json.dumps(hf_config, indent=2, sort_keys=True) + "\n").encode()
    return write_folder(directory, files, {"model.safetensors": tensors}, save=save_file)


def _tokenizer_files(
    tokenizer: SavesTokenizer,
    special_tokens: Mapping[str, str] | None,
    model: nn.Module,
    mapping: HFMapping,
    hf_config: dict[str, Any],
) -> dict[str, bytes]:
    """The tokenizer's files of an export (name -> bytes, as `Tokenizer.save` writes them);
    sets the special tokens' ids in `hf_config` where the mapping says so."""
    if special_tokens is None:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        special_tokens = {
            role: next(c for c in candidates if c in vocab)
            for role, candidates in mapping.special_tokens.items()
            if any(c in vocab for c in candidates)
        }
    token_to_id = getattr(tokenizer, "token_to_id", None)
    if mapping.writes_special_token_ids and token_to_id is not None:
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
    if mapping.model_input_names is not None:
        tokenizer_config["model_input_names"] = list(mapping.model_input_names)
    log.info("export's tokenizer has special tokens %s", dict(special_tokens))
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True).encode(),
        "tokenizer_config.json": (json.dumps(tokenizer_config, indent=2) + "\n").encode(),
        "special_tokens_map.json": json.dumps(dict(special_tokens), indent=2).encode(),
    }
