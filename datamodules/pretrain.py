"""`PretrainDataModule`: the LightningDataModule of BERT (MLM + NSP) and GPT (causal LM) runs.

    dm = PretrainDataModule(corpus, tokenizer, MaskedLMObjective(), cache_dir)
    trainer.fit(module, datamodule=dm)

- `prepare_data` (Lightning runs it on local rank 0) builds the token stores if they are missing
  or damaged; `setup` opens them on every rank (building, or waiting for the builder, when
  `prepare_data` did not run), holds out the validation documents and builds the datasets.
- `check_documents` (which `make pretrain` calls before the run writes anything) builds the
  training store and checks that its documents make the run's splits: a corpus too small for
  the run fails there, saying how many documents it needs, why, and the settings that fix it.
- Batches are the objective's (`Objective.make_batches`, `datamodules.objectives.batches`);
  each rank reads a disjoint share (`datamodules.objectives.sharding`).
- `state_dict()` records the position (phase, epoch, optimizer steps done in the epoch), the
  seed that, with the position, determines every batch, and the fingerprint of the text read
  (`datamodules.stores.resume_text`); Lightning saves it in checkpoints.
  `load_state_dict()` makes the next training epoch start exactly there: a resumed run gets the
  batches the uninterrupted run would have got next, without replaying the skipped ones.

Phases (`objective.phases`, `datamodules.objectives.objective.phase_plan`): each phase has its own
batches (its sequence length, batch size, masking), all read from the one token store. A
phase's epochs end early at its last step; the Trainer must then ask for the next epoch's
loader (`reload_dataloaders_every_n_epochs=1`), which belongs to the phase that the run's
optimizer step count is in. Validation batches are the first phase's throughout, so that the
validation curve stays comparable across a switch.

Which stores a run reads, and building them ahead of training (`make prepare`), are in
`datamodules.run_stores`. With `streaming=True` there is no store: the loader's workers read and
tokenize the corpus as training goes (`datamodules.streaming.read`, `datamodules.streaming.loader`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import lightning as L
import numpy as np
import torch
from tokenizers import Tokenizer

from datamodules.corpora.corpus import DataSetupError
from datamodules.corpora.mixture import MixtureCorpus
from datamodules.objectives.batches import TRAIN, VAL, EpochBatches, StepBatches
from datamodules.objectives.loaders import BatchLoader, PositionLoader
from datamodules.objectives.mixed import InterleavedBatches, MixtureBatches, mixture_batches
from datamodules.objectives.objective import Objective, Phase, phase_plan
from datamodules.objectives.position import (
    STATE_VERSION,
    batches_key,
    check_same_batches,
    restored_phase,
)
from datamodules.objectives.sharding import EpochSampler, process_place
from datamodules.objectives.splits import RunDocuments
from datamodules.run_stores import RunStores, corpora_of, prepare_stores, store_settings
from datamodules.stores.build import open_or_build_store
from datamodules.stores.resume_text import sources_changed, store_fingerprints
from datamodules.stores.store import StoreStats, TokenStore
from datamodules.streaming.loader import StreamLoader
from datamodules.streaming.mixed import streamed_data
from datamodules.validation import ExtraValidation, ValidationBatchMaker, check_validation
from tokenizer import SpecialIds

log = logging.getLogger(__name__)


class PretrainDataModule(L.LightningDataModule):
    """Token stores, NSP/MLM or packed batches, validation split, sharding and resume.

    Args:
        corpus: training corpus (`datamodules.corpora.corpus`).
        tokenizer: the run's tokenizer (`tokenizer.get_tokenizer`).
        objective: the run's `Objective` (its stores, batches and splits).
        cache_dir: root of the caches; stores go to `<cache_dir>/token_stores/<key>/`.
        seed: data seed (>= 0): validation split, epoch orders, NSP pairs and masks.
        val_fraction: share of documents held out for validation when no `val_corpus` is
            given (whole documents; at least 2 with NSP); 0 disables validation.
        val_corpus: a separate validation corpus (then all training documents are used).
        val_max_tokens, extra_validation: the tokens each validation set reads at most, and
            named extra validation corpora, logged as val/<name>/ (`datamodules.validation`).
        num_workers: DataLoader worker processes (batches are identical for any number).
        micro_batches: training batches per optimizer step (gradient accumulation): the
            loader hands out whole steps (`datamodules.objectives.batches.StepBatches`), and the
            position counts steps.
        max_steps: the run's optimizer steps, which `objective.phases` split (needed only with
            phases).
        pin_memory: pin batches for faster host-to-GPU copies.
        persistent_workers: keep workers alive between epochs (with num_workers > 0).
        chunk_mb: text per tokenization chunk when building a store (bounds memory).
        wait_timeout_s: how long ranks other than 0 wait for rank 0 to build a store.
        streaming: read and tokenize the corpus on the fly in the loader workers instead of
            from a token store (`datamodules.streaming.read`).
        shuffle_buffer_mb: streaming: text per shuffled block, in MB.
        rank, world_size: this process's shard outside a Trainer (inside one, the Trainer's
            global rank and world size are used); default: torch.distributed, else 0 of 1.
    """

    def __init__(
        self,
        corpus,
        tokenizer: Tokenizer,
        objective: Objective,
        cache_dir: str | os.PathLike,
        *,
        seed: int = 1234,
        val_fraction: float = 0.01,
        val_corpus=None,
        val_max_tokens: int | None = None,
        extra_validation: Mapping[str, Any] | None = None,
        num_workers: int = 0,
        micro_batches: int = 1,
        max_steps: int | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        chunk_mb: float = 4.0,
        wait_timeout_s: float = 6 * 3600,
        streaming: bool = False,
        shuffle_buffer_mb: float = 4.0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        check_validation(val_fraction, val_corpus, extra_validation)
        self.corpus = corpus
        self.mixture = corpus if isinstance(corpus, MixtureCorpus) else None
        self.source_names: list[str] = self.mixture.names if self.mixture else []
        self.tokenizer = tokenizer
        self.objective = objective
        self.cache_dir = cache_dir
        self.seed = seed
        self.val_fraction = val_fraction
        self.val_corpus = val_corpus
        self.num_workers = num_workers
        self.micro_batches = micro_batches
        self.phases: list[Phase] = phase_plan(objective, max_steps)
        if self.mixture is not None and (val_corpus is not None or len(self.phases) > 1):
            raise DataSetupError(
                "data=mixture holds out each source's own validation documents and samples one "
                "batch layout: it takes neither a separate validation corpus nor objective.phases"
                " (not supported yet); drop objective.phases, or train on one corpus"
            )
        self.phase = 0  # the phase of the current (or next) training epoch
        self.pin_memory = pin_memory
        # a stream's loader is iterated once: its workers live as long as the run
        self.persistent_workers = persistent_workers and num_workers > 0 and not streaming
        self.chunk_mb = chunk_mb
        self._rank, self._world_size = rank, world_size
        self.settings = store_settings(objective, tokenizer)
        self.make_batches = ValidationBatchMaker(tokenizer, val_max_tokens)
        self.extra_validation = ExtraValidation(extra_validation, self.source_names)
        self.special: SpecialIds = self.make_batches.special
        self.stream = None
        if streaming:  # one corpus's stream, or a mixture's (refused when it cannot be)
            self.stream = streamed_data(
                corpus,
                tokenizer,
                self.settings,
                objective,
                seed=seed,
                micro_batches=micro_batches,
                num_workers=num_workers,
                val_fraction=val_fraction if val_corpus is None else 0.0,
                block_mb=shuffle_buffer_mb,
            )
        self.stores = RunStores(
            tokenizer, self.settings, cache_dir, self.mixture, chunk_mb, wait_timeout_s
        )
        self.documents = RunDocuments(
            self.stores,
            corpora_of(corpus),
            val_corpus,
            self.phases[0].objective,
            val_fraction,
            seed,
        )
        self.store: TokenStore | None = None
        self.train_documents = self.val_documents = np.empty(0, dtype=np.int64)
        # per source (one for a single corpus): (store, training documents)
        self.source_splits: list[tuple[TokenStore, np.ndarray]] = []
        self.train_sets: list[EpochBatches] = []  # one per phase
        self.val_set: EpochBatches | None = None
        self.step_batches: list[StepBatches] = []  # one per phase: its optimizer steps
        self._samplers: list[EpochSampler] = []
        self._loader: PositionLoader | None = None
        self._pending: dict[str, Any] | None = None

    @property
    def stats(self) -> list[StoreStats]:
        """Stats of the stores opened or built (training first)."""
        return self.stores.stats + self.extra_validation.stats

    @property
    def train_set(self) -> EpochBatches | None:
        """The current phase's training batches (None before `setup`)."""
        return self.train_sets[self.phase] if self.train_sets else None

    @property
    def train_steps(self) -> StepBatches | None:
        """The current phase's optimizer steps (lists of micro-batches)."""
        return self.step_batches[self.phase] if self.step_batches else None

    @property
    def _sampler(self) -> EpochSampler | None:
        return self._samplers[self.phase] if self._samplers else None

    # Lightning hooks -------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Build the stores (Lightning calls this on local rank 0 before `setup`); a stream
        has none, but a separate validation corpus."""
        if self.stream is not None:  # no gathering here: the other ranks wait at a barrier
            if self.val_corpus is not None:
                open_or_build_store(
                    self.val_corpus,
                    self.tokenizer,
                    self.settings,
                    self.cache_dir,
                    chunk_mb=self.chunk_mb,
                )
            return
        self.stores.stats = prepare_stores(
            self.corpus,
            self.tokenizer,
            self.objective,
            self.cache_dir,
            val_corpus=self.val_corpus,
            chunk_mb=self.chunk_mb,
        )

    def setup(self, stage: str | None = None) -> None:
        """Open the stores, split the documents and build this rank's datasets (once)."""
        if self.train_sets:
            return
        rank, world_size, builder = process_place(self.trainer, self._rank, self._world_size)
        shard = {"rank": rank, "world_size": world_size, "seed": self.seed}
        first = self.phases[0].objective
        self.extra_validation.make(self.stores, builder, self.make_batches, first, shard)
        if self.stream is not None:
            self._setup_stream(shard, builder)
            return
        # per source: (store, training documents, validation store, documents)
        splits = self.documents.splits(world_size, builder)
        self.store, self.train_documents, _, self.val_documents = splits[0]
        self.source_splits = [(store, docs) for store, docs, _, _ in splits]
        val = {"split": VAL, "shuffle": False, **shard}
        val_sets = [
            self.make_batches(st, docs, first, **val) for _, _, st, docs in splits if len(docs)
        ]
        if val_sets:
            self.val_set = val_sets[0] if self.mixture is None else InterleavedBatches(val_sets)
        for phase in self.phases:
            train = {"split": TRAIN, "shuffle": True, **shard}
            if self.mixture is None:
                batches = self.make_batches(
                    self.store, self.train_documents, phase.objective, **train
                )
            else:
                batches = self._mixture_batches(phase.objective, train)
            self.train_sets.append(batches)
            self.step_batches.append(StepBatches(self.train_sets[-1], self.micro_batches))
            self._samplers.append(EpochSampler(len(self.step_batches[-1])))
            log.info(
                "rank %d/%d: %d training documents, %d validation documents, %d batches "
                "(%d optimizer steps) per epoch%s",
                rank,
                world_size,
                sum(len(docs) for _, docs in self.source_splits),
                sum(len(docs) for _, _, _, docs in splits),
                len(self.train_sets[-1]),
                len(self.step_batches[-1]),
                f" in phase {phase.index} (from step {phase.first_step}, sequences of "
                f"{phase.objective.seq_len} tokens)"
                if len(self.phases) > 1
                else "",
            )
        if self._pending is not None:
            self._apply(self._pending)

    def train_dataloader(self) -> PositionLoader | StreamLoader:
        self._require_setup()
        if self.stream is not None:
            self._loader = self.stream.loader(self, self.pin_memory and torch.cuda.is_available())
            return self._loader
        self._enter_phase()
        self._loader = self._loader_for(self.train_steps, self._sampler, PositionLoader)
        self._loader.micro_batches = self.micro_batches
        self._loader.position = self._sampler.next_position()
        self._loader.datamodule = self
        return self._loader

    def val_dataloader(self) -> BatchLoader | list:
        self._require_setup()
        sets = ([] if self.val_set is None else [self.val_set]) + self.extra_validation.sets
        loaders = [self._loader_for(s, EpochSampler(len(s), follow_epochs=False)) for s in sets]
        return loaders if len(loaders) != 1 or self.extra_validation.sets else loaders[0]

    def state_dict(self) -> dict[str, Any]:
        """The training position: epoch, optimizer steps done in it, and what fixes the
        batches."""
        epoch, step = self.position()
        if self.stream is not None:
            return {"version": STATE_VERSION, "streaming": self.stream.state_dict(step)}
        return {
            "version": STATE_VERSION,
            "phase": self.phase,
            "epoch": epoch,
            "step": step,
            **batches_key(self.train_set, self.seed, self.micro_batches),
            **({"mixture": self.mixture.spec()} if self.mixture else {}),
            "corpus": store_fingerprints(self.source_splits, self.source_names),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict()`: the next training epoch starts at its position."""
        if ("streaming" in state_dict) != (self.stream is not None):
            saved = "streamed" if "streaming" in state_dict else "read from a token store"
            raise DataSetupError(
                f"cannot resume the data position: the checkpoint's data was {saved}; resume with "
                f"datamodule.streaming={str('streaming' in state_dict).lower()}, or start afresh"
            )
        if self.stream is not None:
            self.stream.load_state_dict(state_dict["streaming"])
        elif not self.train_sets:
            self._pending = dict(state_dict)
        else:
            self._apply(state_dict)

    # helpers ---------------------------------------------------------------------------------

    def check_documents(self, world_size: int = 1) -> None:
        """Build (or reuse) the training store and check that its documents make the run's
        splits, as `setup` will (from document lengths only: cheap), so that a corpus too small
        for the run fails before the run writes anything.

        Raises:
            DataSetupError: naming how many documents or tokens the run needs and why.
        """
        if self.stream is not None:  # validation held out, then the first block
            self.stream.setup(0, world_size, validate=self.val_corpus is None)
            self.stream.first_step()
            return
        self.documents.check(world_size, [phase.objective for phase in self.phases])

    def training_documents(self, world_size: int = 1) -> Iterator[np.ndarray]:
        """The token ids of every training document, in store order, the validation documents
        held out as `setup` holds them out for `world_size` processes (the store is built if
        it is not in the cache; a stream's are tokenized as they are read). What counting
        models of the run's corpus count (a mixture's sources one after another, each once,
        whatever its weight)."""
        if self.stream is not None:
            yield from self.stream.training_documents(world_size)
            return
        yield from self.documents.training(world_size)

    def train_document_tokens(self) -> Iterator[np.ndarray]:
        """The token ids of this run's training documents, after `setup` (every source's)."""
        if self.stream is not None:
            yield from self.stream.training_documents()
            return
        for store, documents in self.source_splits:
            yield from (store.document(int(i)) for i in documents)

    def source_progress(self) -> dict[str, dict[str, float]]:
        """Per source of a mixture, what training has read so far (`MixtureBatches.progress`);
        empty for a single corpus."""
        if self.stream is not None:
            return self.stream.progress(self.position()[1])
        batches = self.train_set
        if not isinstance(batches, MixtureBatches):
            return {}
        epoch, steps = self.position()
        return batches.progress(self.source_names, epoch, steps * self.micro_batches)

    def _mixture_batches(self, objective: Objective, shard: dict[str, Any]) -> MixtureBatches:
        """A mixture's training batches of `objective`: every source's items, unsharded."""
        whole = shard | {"rank": 0, "world_size": 1}
        sources = [
            self.make_batches(st, docs, objective, **whole) for st, docs in self.source_splits
        ]
        return mixture_batches(sources, self.mixture, self.source_names, self.special.pad, shard)

    def _setup_stream(self, shard: dict[str, Any], builder: bool) -> None:
        """A streamed run's stream and validation batches (held out, or val_corpus's)."""
        stores = self.stream.setup(shard["rank"], shard["world_size"], self.val_corpus is None)
        if self.val_corpus is not None:
            stores = [self.stores.open(self.val_corpus, builder)]
        val = {"split": VAL, "shuffle": False, **shard}
        self.val_set = self.stream.validation_set(stores, self.make_batches, val)
        self.train_sets = [self.stream.dataset]

    def _steps_done(self) -> int | None:
        """Optimizer steps the run has made (None outside a Trainer's fit)."""
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == "fit":
            return trainer.global_step
        return None

    def _enter_phase(self) -> None:
        """Make the phase of the run's step count current, and bound its sampler so that the
        coming epoch ends at the phase's last step. Outside a Trainer's fit the phase stays
        the restored (or first) one."""
        done = self._steps_done()
        if done is not None:
            self.phase = max(p.index for p in self.phases if p.first_step <= done)
        end = self.phases[self.phase].end_step
        sampler = self._sampler
        sampler.stop = (
            None if end is None or done is None else sampler.next_position()[1] + end - done
        )

    def _loader_for(self, dataset, sampler: EpochSampler, cls=BatchLoader) -> BatchLoader:
        pin = self.pin_memory and torch.cuda.is_available()
        workers = {"num_workers": self.num_workers, "persistent_workers": self.persistent_workers}
        return cls.over(dataset, sampler, seed=self.seed, pin=pin, **workers)

    def position(self) -> tuple[int, int]:
        """(epoch, optimizer steps of it consumed by training; a stream's count all its steps)."""
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == "fit":
            # Lightning fetches one batch ahead, so count the batches the loop has processed
            # (an internal that pipeline/training/lightning_compat.INTERNALS lists for its check).
            progress = trainer.fit_loop.epoch_loop.batch_progress
            done = (progress.total if self.stream is not None else progress.current).processed
            return trainer.current_epoch, done // self.micro_batches
        if self.stream is not None:
            return 0, self.stream.position.handed if self.stream.position else 0
        if self._loader is not None:
            return self._loader.position
        if self._pending is not None:
            return self._pending["epoch"], self._pending["step"]
        return 0, 0

    def _apply(self, state: dict[str, Any]) -> None:
        self._pending = None
        self.phase = restored_phase(state, len(self.phases))
        now = store_fingerprints(self.source_splits, self.source_names)
        if refusal := sources_changed(state, self.corpus, now):
            raise DataSetupError(refusal)
        check_same_batches(state, batches_key(self.train_set, self.seed, self.micro_batches))
        self._sampler.resume(int(state["epoch"]), int(state["step"]))
        where = (self.phase, state["epoch"], state["step"])
        log.info("data position restored: phase %d, epoch %d, step %d", *where)

    def _require_setup(self) -> None:
        if not self.train_sets:
            raise RuntimeError("call setup() before asking for dataloaders")
