"""Tiny pretraining runs under Lightning DDP on 2 CPU processes (gloo), for `test_ddp.py`.

    python tests/pipeline/ddp_run.py RUNS_JSON

RUNS_JSON holds a list of runs, each a mapping of `main`'s arguments (family, tokenizer_json,
cache_dir, out, steps, k, optim, word_vectors). Lightning starts rank 1 by re-running this
script at the first run's `fit`; the runs after it join the same two processes and process group
(starting a Python with torch and Lightning costs more than a tiny run), each from its own seed,
tokenizer, cache and model. Every rank writes `OUT_DIR/rank<r>.pt` for each run:
the weights after DDP's start-up broadcast and after training, the gradients and micro-batches
of the first optimizer step, its token store and epoch-0 item order, and, for every batch it
trained on: its (epoch, index) in the rank's dataset, whether the loader's batch is exactly the
dataset's batch at that key, the item ids the batch holds, and what text they are (`content`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT, which this asks for)
from datamodules.corpora.corpus import EmbeddedCorpus
from datamodules.objectives.batches import STEP_TOTAL
from datamodules.objectives.bert_batches import BertBatches
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.pretrain import PretrainDataModule
from models.config import BertConfig, GPTConfig
from pipeline.pretrain.corpus_init import CorpusInit
from pipeline.run.families import family_named
from pipeline.training.muon import MuonWithAdamW
from pipeline.training.schedules import warmup_cosine, warmup_linear_decay
from tokenizer import load_tokenizer

SEED = 7
WORLD_SIZE = 2


def model_config(family: str, tokenizer_vocab: int) -> BertConfig | GPTConfig:
    """The tiny preset; dropout off so that the test can recompute the first step's gradients."""
    vocab = family_named(family).model_vocab_size(tokenizer_vocab)
    if family == "bert":
        return BertConfig.from_preset("tiny", vocab_size=vocab, dropout=0.0, attn_dropout=0.0)
    return GPTConfig.from_preset("tiny", vocab_size=vocab)


def objective(family: str) -> MaskedLMObjective | CausalLMObjective:
    if family == "bert":
        return MaskedLMObjective(seq_len=64, batch_size=4, max_predictions_per_seq=10)
    return CausalLMObjective(seq_len=64, batch_size=4)


def optimizer_and_schedule(family: str, optimizer: str = "adamw"):
    """The partials `conf/optim/adamw_*.yaml` (or `muon.yaml`) and `conf/schedule/*.yaml`
    instantiate to."""
    if optimizer == "muon":
        muon = functools.partial(MuonWithAdamW, lr=1e-3, weight_decay=0.1)
        return muon, functools.partial(warmup_cosine, warmup_steps=1)
    if family == "bert":
        optimizer = functools.partial(
            torch.optim.AdamW, lr=5e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01
        )
        return optimizer, functools.partial(warmup_linear_decay, warmup_steps=1)
    optimizer = functools.partial(
        torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    return optimizer, functools.partial(warmup_cosine, warmup_steps=1)


def parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def content(dataset, epoch: int, items, batch: dict[str, torch.Tensor]) -> list[tuple]:
    """What text a batch's items are: a BERT instance's segment A (token offsets into the
    store, unique per instance of an epoch), a GPT window's tokens."""
    if isinstance(dataset, BertBatches):
        return [tuple(span) for span in dataset.instances(epoch)[items][:, :2].tolist()]
    return [tuple(row) for row in batch["input_ids"].tolist()]


class Recorder(L.Callback):
    """Records what this rank trained on and its weights, and saves them when training ends."""

    def __init__(self, out_dir: Path, micro_batches: int) -> None:
        self.out_dir = out_dir
        self.micro_batches = micro_batches
        self.record: dict = {"batches": [], "first_step_batches": []}

    def on_train_start(self, trainer, pl_module) -> None:
        self.record["initial"] = parameters(pl_module.model)  # after DDP's broadcast

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # A fresh run starts its epoch at batch 0 of the rank's dataset, so Lightning's
        # batch_idx should be the dataset index (micro-batch j of step s is index s * k + j):
        # `matches_dataset` checks that the loader handed out exactly that batch.
        dataset = trainer.datamodule.train_set
        epoch = trainer.current_epoch
        expected = dataset[(epoch, batch_idx)]
        same = set(expected) == {k for k in batch if not k.startswith(STEP_TOTAL)} and all(
            torch.equal(batch[name], torch.from_numpy(array)) for name, array in expected.items()
        )
        items = dataset.batch_items(epoch, batch_idx)
        self.record["batches"].append(
            {
                "epoch": epoch,
                "index": batch_idx,
                "matches_dataset": same,
                "items": items.tolist(),
                "content": content(dataset, epoch, items, batch),
            }
        )
        if batch_idx < self.micro_batches:
            self.record["first_step_batches"].append({k: v.clone() for k, v in batch.items()})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:  # after the last micro-batch's backward and all-reduce
            self.record["first_step_grads"] = {
                name: p.grad.detach().clone() for name, p in pl_module.model.named_parameters()
            }

    def on_train_end(self, trainer, pl_module) -> None:
        datamodule = trainer.datamodule
        self.record |= {
            "store": str(datamodule.store.path),
            "order": datamodule.train_set.order(0).tolist(),
            "final": parameters(pl_module.model),
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "backend": torch.distributed.get_backend(),
            "model_config": dataclasses.asdict(pl_module.model_config),
        }
        torch.save(self.record, self.out_dir / f"rank{trainer.global_rank}.pt")


def main(
    family: str,
    tokenizer_json: str,
    cache_dir: str,
    out: str,
    steps: int,
    k: int,
    optim: str,
    word_vectors: bool = False,
) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    L.seed_everything(SEED, workers=True)
    tokenizer = load_tokenizer(tokenizer_json)  # trained once, by the test: the same on both ranks
    datamodule = PretrainDataModule(
        EmbeddedCorpus(),
        tokenizer,
        objective(family),
        cache_dir,
        seed=SEED,
        val_fraction=0.0,
        micro_batches=k,
        wait_timeout_s=120,
    )
    optimizer, schedule = optimizer_and_schedule(family, optim)
    module = family_named(family).module_class(
        model_config(family, tokenizer.get_vocab_size()),
        optimizer=optimizer,
        scheduler=schedule,
        schedule_steps=steps,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        # "ddp" with a timeout: a rank whose peer died fails instead of waiting 30 minutes.
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=120)),
        precision="32-true",
        max_steps=steps,
        accumulate_grad_batches=k,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        # word vectors (pipeline/pretrain/corpus_init.py) before the recorder's look at the initial weights
        callbacks=[*([CorpusInit(window=5)] if word_vectors else []), Recorder(Path(out), k)],
    )
    trainer.fit(module, datamodule=datamodule)


if __name__ == "__main__":
    for run in json.loads(Path(sys.argv[1]).read_text()):
        main(**run)
