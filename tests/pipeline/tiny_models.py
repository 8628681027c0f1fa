"""Tiny trained-model stand-ins for the inference tests: tokenizers trained on real prose,
randomly initialized models, and checkpoints written exactly as `make pretrain` writes them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path

import torch
from tokenizers import Tokenizer

from models.bert import BertForPreTraining
from models.config import BertConfig, GPTConfig, round_up
from models.gpt import GPT
from tokenizer import batched, train_tokenizer

KINDS = {"bert": "wordpiece", "gpt": "bpe"}


@functools.cache
def _tokenizer_json(kind: str) -> str:
    from datamodules.corpora.corpus import EmbeddedCorpus

    docs = list(itertools.islice(EmbeddedCorpus().documents(), 30))  # as the small_docs fixture
    return train_tokenizer(kind, batched(docs), vocab_size=1000).to_str()


def trained_tokenizer(kind: str) -> Tokenizer:
    """A `kind` tokenizer of 1,000 tokens trained on the embedded corpus (cached per session)."""
    return Tokenizer.from_str(_tokenizer_json(kind))


def tiny_model(family: str, tokenizer: Tokenizer, seed: int = 0, **overrides):
    """A randomly initialized 2-layer model sized for `tokenizer`, in eval mode."""
    torch.manual_seed(seed)
    vocab = tokenizer.get_vocab_size()
    if family == "gpt":
        config = GPTConfig.from_preset("tiny", vocab_size=round_up(vocab, 64), **overrides)
        return GPT(config).eval()
    config = BertConfig(
        vocab_size=vocab, n_layers=2, d_model=64, n_heads=2, max_seq_len=128, **overrides
    )
    return BertForPreTraining(config).eval()


def checkpoint_dict(model, tokenizer: Tokenizer, family: str) -> dict:
    """What `make pretrain` saves: Lightning's entries plus model_config, tokenizer, config."""
    state = {f"model.{name}": value for name, value in model.state_dict().items()}
    state["val_metrics.loss.mean_value"] = torch.tensor(3.5)  # not the model's: ignored
    return {
        "epoch": 0,
        "global_step": 5,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": state,
        "model_config": {"family": family, **dataclasses.asdict(model.config)},
        "tokenizer": {"kind": KINDS[family], "json": tokenizer.to_str()},
        "config": {"seed": 1234, "model": {"n_layers": model.config.n_layers}},
    }


def write_run(run_dir: Path, family: str, seed: int = 0, **overrides):
    """A run folder with `checkpoints/last.ckpt`; returns (model, tokenizer, checkpoint path)."""
    tokenizer = trained_tokenizer(KINDS[family])
    model = tiny_model(family, tokenizer, seed, **overrides)
    path = run_dir / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(checkpoint_dict(model, tokenizer, family), path)
    return model, tokenizer, path


def write_fine_tuned(
    run_dir: Path, pretrained: Path, named: str, cwd: Path, task: str = "sst2"
) -> Path:
    """A fine-tuning run folder as `make finetune task=<task> ckpt=<named>` run in `cwd`
    leaves it, from the checkpoint file `pretrained`: `checkpoints/best.ckpt` holding a task
    head on the backbone, the `finetune` entry and the run's config (`ckpt` as given), and
    Hydra's record of the working folder. Returns the run folder."""
    contents = torch.load(pretrained, map_location="cpu", weights_only=True)
    state = {
        f"model.backbone.{key.removeprefix('model.')}": value
        for key, value in contents["state_dict"].items()
        if key.startswith("model.")
    }
    width = contents["model_config"]["d_model"]
    state |= {"model.head.weight": torch.zeros(2, width), "model.head.bias": torch.zeros(2)}
    contents["state_dict"] = state
    contents["finetune"] = {
        "task": task,
        "kind": "classification",
        "labels": ["0", "1"],
        "metrics": ["accuracy"],
    }
    contents["config"] = {"ckpt": named, "from_scratch": False, "task": {"name": task}}
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save(contents, run_dir / "checkpoints" / "best.ckpt")
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {cwd}\n")
    return run_dir
