"""`make pretrain`: pretrain a BERT or GPT on a corpus.

    python -m pipeline.pretrain model=gpt trainer.max_steps=50

Checks the config, gets the tokenizer (cached), builds the token store (cached), trains with
Lightning, checkpoints atomically, exports the final model in Hugging Face format and prints
where everything is.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from datamodules.pretrain import PretrainDataModule
from models.config import round_up
from models.hf import export_hf
from pipeline.callbacks import AtomicCheckpointIO, Throughput
from pipeline.cli import entry_point, user_errors
from pipeline.config import ConfigError, RunPlan, check_config
from pipeline.modules import module_for
from tokenizer import get_tokenizer

log = logging.getLogger(__name__)


def best_precision() -> str:
    """bf16 mixed precision on GPUs that support it, else full fp32."""
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def model_vocab_size(tokenizer_vocab: int, family: str) -> int:
    """GPT embedding rows are padded to a multiple of 64 for fast matmuls (the extra rows are
    never targets); BERT keeps the tokenizer's size so that exported checkpoints match it."""
    return round_up(tokenizer_vocab, 64) if family == "gpt" else tokenizer_vocab


def build_trainer(cfg: DictConfig, run_dir: Path) -> L.Trainer:
    checkpoints = ModelCheckpoint(
        dirpath=run_dir / "checkpoints",
        filename="step{step:07d}",
        auto_insert_metric_name=False,
        every_n_train_steps=cfg.checkpoint.every_n_steps,
        save_last=True,
        save_top_k=cfg.checkpoint.keep_best,
        monitor="val/loss",
        mode="min",
    )
    loggers = [instantiate(node) for node in (cfg.logger or {}).values()]
    return instantiate(
        cfg.trainer,
        precision=cfg.trainer.precision or best_precision(),
        logger=loggers or False,
        callbacks=[Throughput(), checkpoints],
        plugins=[AtomicCheckpointIO()],
    )


def train(cfg: DictConfig, plan: RunPlan) -> None:
    if cfg.trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches > 1 is not supported yet (losses must be normalized "
            "by the token count of the whole accumulation window); raise objective.batch_size"
        )
    L.seed_everything(cfg.seed, workers=True)
    run_dir = Path(cfg.paths.output_dir)
    tokenizer = get_tokenizer(plan.tokenizer, plan.corpus, cfg.paths.cache_dir)
    model_config = dataclasses.replace(
        plan.model, vocab_size=model_vocab_size(tokenizer.get_vocab_size(), plan.family)
    )
    datamodule = PretrainDataModule(
        plan.corpus,
        tokenizer,
        plan.tokenizer.kind,
        plan.objective,
        cfg.paths.cache_dir,
        seed=cfg.seed,
        **cfg.datamodule,
    )
    module = module_for(plan.family)(
        model_config, optimizer=instantiate(cfg.optim), scheduler=instantiate(cfg.schedule)
    )
    trainer = build_trainer(cfg, run_dir)
    if trainer.is_global_zero:
        tokenizer.save(str(run_dir / "tokenizer.json"))
        print(f"{plan.family} model, {module.parameter_count():,} parameters; run folder {run_dir}")
    trainer.fit(module, datamodule=datamodule)
    if trainer.is_global_zero:
        export_dir = export_hf(module.model, run_dir / "hf", tokenizer=tokenizer)
        print_summary(trainer, run_dir, export_dir, plan.family)


def print_summary(trainer: L.Trainer, run_dir: Path, export_dir: Path, family: str) -> None:
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()) if k.startswith("val/"))
    last = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else ""
    print(f"\nfinished {trainer.global_step} steps" + (f": {shown}" if shown else ""))
    places = {
        "checkpoint": Path(last) if last else None,
        "HF export": export_dir,
        "metrics": run_dir / "logs" / "metrics.csv",
        "config": run_dir / ".hydra" / "config.yaml",
    }
    for label, path in places.items():
        if path is not None and path.exists():  # e.g. no metrics file when loggers are off
            print(f"  {label:<11} {path}")
    if family == "gpt":
        print(f"next: load {export_dir} with transformers.AutoModelForCausalLM")
    else:
        print(f"next: load {export_dir} with transformers.AutoModelForPreTraining")


@hydra.main(config_path="../conf", config_name="pretrain", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        plan = check_config(cfg)
        log.info("resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
        train(cfg, plan)


if __name__ == "__main__":
    entry_point(main)
