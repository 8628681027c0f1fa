"""Exact resume: after restoring a mid-epoch position, the batches equal those of an uninterrupted
run, with 0 and 2 DataLoader workers, across epoch boundaries, and through a Lightning
checkpoint."""

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules.corpora.corpus import DataSetupError, TextFilesCorpus
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.pretrain import PretrainDataModule

SETTINGS = {
    "bert": ("wordpiece", MaskedLMObjective(seq_len=64, batch_size=16)),
    "gpt": ("bpe", CausalLMObjective(seq_len=64, batch_size=16, document_masking=True)),
}


@pytest.fixture
def make_dm(request, embedded, cache_dir):
    def make(model: str, num_workers: int = 0, seed: int = 5) -> PretrainDataModule:
        kind, objective = SETTINGS[model]
        tokenizer = request.getfixturevalue(kind)
        return PretrainDataModule(
            embedded, tokenizer, objective, cache_dir, seed=seed, num_workers=num_workers
        )

    return make


def run(dm: PretrainDataModule, epochs: range, stop: int | None = None) -> list[dict]:
    """Iterate like a training loop (set_epoch per epoch); stop after `stop` batches."""
    dm.setup("fit")
    loader = dm.train_dataloader()
    seen = []
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            seen.append(batch)
            if len(seen) == stop:
                return seen
    return seen


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_resume_mid_epoch_gives_the_uninterrupted_batches(model, num_workers, make_dm):
    full_dm = make_dm(model, num_workers)
    per_epoch = (full_dm.setup("fit"), len(full_dm.train_set))[1]
    stop = per_epoch + per_epoch // 3  # a third into the second epoch
    full = run(full_dm, range(3), stop=stop + 10)

    first = make_dm(model, num_workers)
    head = run(first, range(3), stop=stop)
    state = first.state_dict()
    assert (state["epoch"], state["step"]) == (1, per_epoch // 3)

    resumed = make_dm(model, num_workers)
    resumed.load_state_dict(state)
    tail = run(resumed, range(state["epoch"], 3), stop=10)
    assert same(head, full[:stop])
    assert same(tail, full[stop:])


def test_resume_refuses_a_different_setup(make_dm):
    state = make_dm("gpt").state_dict()
    dm = make_dm("gpt", seed=6)
    dm.setup("fit")
    with pytest.raises(ValueError, match="seed=5, this run 6"):
        dm.load_state_dict(state | {"batches_per_epoch": len(dm.train_set)})


class Recorder(L.LightningModule):
    """Records a fingerprint of every training batch; trains one dummy parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        self.seen.append((int(ids.sum()), *ids.shape, int(ids[0, :8].sum())))
        return self.weight**2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(dm, max_steps: int, tmp_path, ckpt_path=None, save_every=None, **trainer) -> list:
    module = Recorder()
    callbacks = (
        [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=save_every, save_top_k=-1)]
        if save_every
        else []
    )
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=bool(save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **trainer,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # few-batch and num_workers advice
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module.seen


@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_lightning_checkpoint_resumes_the_data_exactly(model, make_dm, tmp_path):
    probe = make_dm(model)
    probe.setup("fit")
    per_epoch = len(probe.train_set)
    cut, total = per_epoch + 7, per_epoch + 20  # checkpoint inside the second epoch
    full = fit(make_dm(model, num_workers=2), total, tmp_path / "full")
    head = fit(make_dm(model, num_workers=2), cut, tmp_path / "part", save_every=cut)
    checkpoint = next((tmp_path / "part").glob("*.ckpt"))
    state = torch.load(checkpoint, weights_only=False)["PretrainDataModule"]
    assert (state["epoch"], state["step"]) == (1, 7)
    tail = fit(make_dm(model, num_workers=2), total, tmp_path / "resumed", ckpt_path=checkpoint)
    assert head == full[:cut]
    assert tail == full[cut:]


@pytest.mark.parametrize("streaming", [False, True], ids=["store", "stream"])
def test_a_position_is_refused_on_edited_text_and_resumes_on_the_text_put_back(
    streaming, embedded, bpe, tmp_path
):
    """Two paragraphs of the corpus swapped (the same size and token count, so the same
    batches per epoch): a store's and a stream's saved position are refused, naming the file;
    with the file as it was, the position is restored."""
    path = tmp_path / "corpus.txt"
    original = "\n\n".join(list(embedded.documents())[:40]) + "\n"
    path.write_text(original)

    def datamodule() -> PretrainDataModule:
        dm = PretrainDataModule(
            TextFilesCorpus(str(path)),
            bpe,
            CausalLMObjective(seq_len=32, batch_size=4),
            tmp_path / "cache",
            streaming=streaming,
        )
        dm.setup("fit")
        return dm

    first = datamodule()
    next(iter(first.train_dataloader()))
    state = first.state_dict()
    paragraphs = original.rstrip("\n").split("\n\n")
    paragraphs[0], paragraphs[1] = paragraphs[1], paragraphs[0]
    path.write_text("\n\n".join(paragraphs) + "\n")
    edited = datamodule()
    assert streaming or len(edited.train_set) == len(first.train_set)
    refusal = rf"^cannot resume the data position: the corpus \({path}; fingerprint \w+, now \w+\)"
    with pytest.raises(DataSetupError, match=refusal):
        edited.load_state_dict(state)
    path.write_text(original)
    datamodule().load_state_dict(state)  # the text it was trained on: restored
