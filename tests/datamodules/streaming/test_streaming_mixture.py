"""Streamed mixtures (`data=mixture datamodule.streaming=true`, datamodules/streaming/mixed.py):
every row comes from the source its step's draw names, the sources' shares match the weights for
both families, and each step's micro-batches carry its loss counts; resume is exact (also through
a Lightning checkpoint); other weights and an edited source are refused with a fix that works;
a mixture by epochs is refused in one line whose fix, pasted, passes the config check; a source
that makes no row fails at setup, named, even at a weight the first step does not draw.
(The SIGKILL-and-resume run: tests/pipeline/test_resume.py::test_killed_streamed_mixture_...)"""

from __future__ import annotations

import re
import shlex
import shutil

import numpy as np
import pytest
import torch

from datamodules.corpora.corpus import DataSetupError, TextFilesCorpus
from datamodules.corpora.mixture import MixtureCorpus
from datamodules.objectives.batches import STEP_TOTAL
from datamodules.pretrain import PretrainDataModule
from datamodules.streaming.mixed import step_rows
from pipeline.pretrain.checks import check_config
from pipeline.run.errors import ConfigError
from tests.conftest import compose_pretrain
from tests.datamodules.streaming.test_streaming import BUFFER_MB, SETTINGS, take
from tests.datamodules.test_resume import fit, same
from tests.pipeline.task_data import point_shipped_corpora_at

NAMES = ("alpha", "beta")
WEIGHTS = (0.7, 0.3)
SEED = 5


@pytest.fixture(scope="module")
def sources(embedded, tmp_path_factory):
    """A folder of two sources of the embedded corpus's paragraphs: alpha.txt (two thirds of
    them) and beta.txt (the rest, each word spelled backwards: the corpus repeats some
    paragraphs and sentences, and a test must tell the sources' rows apart); prose only."""
    folder = tmp_path_factory.mktemp("sources")
    texts = [p for doc in embedded.documents() for p in doc.split("\n") if len(p) > 200]
    texts = [t for t in texts if sum(c.isalpha() for c in t) > 0.6 * len(t)]  # no tables
    backwards = [re.sub("[a-z]+", lambda word: word[0][::-1], t) for t in texts[::3]]
    (folder / "alpha.txt").write_text("\n\n".join(t for i, t in enumerate(texts) if i % 3) + "\n")
    (folder / "beta.txt").write_text("\n\n".join(backwards) + "\n")
    return folder


def mixture(folder, weights=WEIGHTS) -> MixtureCorpus:
    corpora = {n: TextFilesCorpus(str(folder / f"{n}.txt"), doc_split="blank_line") for n in NAMES}
    return MixtureCorpus(corpora, weights=dict(zip(NAMES, weights, strict=True)))


@pytest.fixture
def make_dm(request, cache_dir, sources):
    def make(model: str, num_workers: int = 0, corpus=None, **kwargs) -> PretrainDataModule:
        kind, objective = SETTINGS[model]
        return PretrainDataModule(
            corpus or mixture(sources),
            request.getfixturevalue(kind),
            objective,
            cache_dir,
            seed=SEED,
            num_workers=num_workers,
            streaming=True,
            shuffle_buffer_mb=BUFFER_MB,
            **kwargs,
        )

    return make


def row_pieces(batch: dict, model: str, special) -> list[list[bytes]]:
    """Each row's token runs that must lie in one source's text: GPT's window; BERT's two
    segments, unmasked."""
    ids = batch["input_ids"].clone()
    if model == "gpt":
        return [[row.astype(np.uint32).tobytes()] for row in ids.numpy()]
    ids.view(-1)[batch["masked_positions"]] = batch["mlm_labels"]
    pieces = []
    for row in ids.numpy():
        seps = np.flatnonzero(row == special.sep)
        segments = [row[1 : seps[0]], row[seps[0] + 1 : seps[1]]]
        pieces.append([s.astype(np.uint32).tobytes() for s in segments])
    return pieces


@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_rows_come_from_the_drawn_sources_in_the_weights_shares(model, make_dm):
    steps = 120
    dm = make_dm(model)
    batches = take(dm, steps)
    # each source's text as its readers read it: its training documents, twice (one unit,
    # read in the same order every epoch: a GPT window may run on into the next epoch)
    texts = []
    for part in dm.stream.parts:
        text = b"".join(d.astype(np.uint32).tobytes() for d in part.training_documents())
        texts.append(text + text)
    read = np.zeros(2, np.int64)
    for step, batch in enumerate(batches):
        found = []
        for pieces in row_pieces(batch, model, dm.special):
            [source] = [s for s, text in enumerate(texts) if all(p in text for p in pieces)]
            found.append(source)
        [drawn] = step_rows(SEED, 0, step, np.array(WEIGHTS), 4, 1)
        assert found == [0] * drawn[0] + [1] * drawn[1], step  # rows in source order
        read += np.bincount(found, minlength=2)
    share = read[1] / read.sum()
    # 480 rows drawn with p = 0.3: a standard deviation of 0.021; 0.07 is over 3 of them
    assert abs(share - WEIGHTS[1]) < 0.07, share
    assert min(read) > 0
    progress = dm.stream.progress(steps)  # what the run logs as data/<source>/sequences
    assert [progress[name]["sequences"] for name in NAMES] == read.tolist()
    if model == "gpt":  # a window's tokens
        assert [progress[name]["tokens"] for name in NAMES] == (read * 32).tolist()


@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_micro_batches_carry_their_steps_loss_counts(model, make_dm):
    dm = make_dm(model, micro_batches=2)
    batches = take(dm, 2 * 8)
    counting = dm.val_set.sources[0]  # an `EpochBatches` of the objective: its loss counts
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        totals = {}
        for batch in (first, second):
            numpy = {k: v.numpy() for k, v in batch.items()}
            for name, count in counting.loss_counts(numpy).items():
                totals[STEP_TOTAL + name] = totals.get(STEP_TOTAL + name, 0) + count
        assert totals
        for name, total in totals.items():
            assert int(first[name]) == int(second[name]) == total, name
    assert len({len(b["input_ids"]) for b in batches}) == 1  # 4 rows, whatever their sources


@pytest.mark.parametrize(("model", "num_workers"), [("bert", 0), ("gpt", 2)])
def test_mixture_resume_gives_the_uninterrupted_steps(model, num_workers, make_dm):
    total, cut = 120, 87
    full = take(make_dm(model, num_workers), total)
    first = make_dm(model, num_workers)
    head = take(first, cut)
    state = first.state_dict()["streaming"]
    assert state["step"] == cut and state["mixture"]["amounts"] == list(WEIGHTS)
    resumed = make_dm(model, num_workers)
    resumed.load_state_dict({"streaming": state, "version": first.state_dict()["version"]})
    tail = take(resumed, total - cut)
    assert same(head, full[:cut])
    assert same(tail, full[cut:])
    sources = [s for saved in state["readers_state"].values() for s in saved["sources"]]
    assert len(sources) == 2 * num_workers or len(sources) == 2
    # resumed inside a later block (re-read, its rows taken skipped) and inside a first one
    assert any(tuple(s["cursor"]) != (0, 0, 0) and s["steps"] > 0 for s in sources)
    assert all(s["steps"] > 0 for s in sources)


def test_a_lightning_checkpoint_resumes_the_mixture_exactly(make_dm, tmp_path):
    full = fit(make_dm("gpt", 2), 24, tmp_path / "full")
    head = fit(make_dm("gpt", 2), 11, tmp_path / "part", save_every=11)
    checkpoint = next((tmp_path / "part").glob("*.ckpt"))
    state = torch.load(checkpoint, weights_only=True)["PretrainDataModule"]
    assert state["streaming"]["step"] == 11
    tail = fit(make_dm("gpt", 2), 24, tmp_path / "resumed", ckpt_path=checkpoint)
    assert head == full[:11]
    assert tail == full[11:]


def test_other_weights_are_refused_naming_the_overrides_that_resume(make_dm, sources):
    first = make_dm("gpt")
    take(first, 5)
    state = first.state_dict()
    reweighted = make_dm("gpt", corpus=mixture(sources, (0.5, 0.5)))
    reweighted.load_state_dict(state)
    with pytest.raises(DataSetupError) as refused:
        reweighted.setup("fit")
    message = str(refused.value)
    assert message.startswith("cannot resume the data position: the checkpoint sampled a mixture")
    fix = re.search(r"\(add (.*)\);", message)[1]
    assert fix == "data.epochs=null 'data.weights={alpha: 0.7, beta: 0.3}'"
    words = dict(word.split("=", 1) for word in shlex.split(fix))  # as a shell hands them over
    assert words == {"data.epochs": "null", "data.weights": "{alpha: 0.7, beta: 0.3}"}
    fixed = make_dm("gpt", corpus=mixture(sources, (0.7, 0.3)))
    fixed.load_state_dict(state)
    fixed.setup("fit")
    assert fixed.stream.position.handed == 5


def test_an_edited_source_is_refused_naming_it_until_it_is_put_back(make_dm, sources, tmp_path):
    for name in NAMES:
        shutil.copy(sources / f"{name}.txt", tmp_path / f"{name}.txt")
    first = make_dm("bert", corpus=mixture(tmp_path))
    take(first, 4)
    state = first.state_dict()
    beta = tmp_path / "beta.txt"
    original = beta.read_text()
    paragraphs = original.rstrip("\n").split("\n\n")
    paragraphs[0], paragraphs[1] = paragraphs[1], paragraphs[0]  # the same size and tokens
    beta.write_text("\n\n".join(paragraphs) + "\n")
    edited = make_dm("bert", corpus=mixture(tmp_path))
    edited.load_state_dict(state)
    with pytest.raises(DataSetupError) as refused:
        edited.setup("fit")
    message = str(refused.value)
    assert message.startswith(f"cannot resume the data position: data.sources.beta ({beta}; ")
    assert "alpha" not in message
    assert "Put the files and settings back as they were and resume again" in message
    beta.write_text(original)
    put_back = make_dm("bert", corpus=mixture(tmp_path))
    put_back.load_state_dict(state)
    put_back.setup("fit")
    assert put_back.stream.position.handed == 4


def test_a_mixture_by_epochs_is_refused_in_one_line_whose_fix_passes(
    make_dm, sources, tmp_path, monkeypatch
):
    corpora = {n: TextFilesCorpus(str(sources / f"{n}.txt")) for n in NAMES}
    by_epochs = MixtureCorpus(corpora, epochs={"alpha": 1, "beta": 3})
    with pytest.raises(DataSetupError) as refused:
        make_dm("gpt", corpus=by_epochs)
    message = str(refused.value)
    assert "\n" not in message and "give each source a share" in message
    assert message.endswith("e.g. data.epochs=null 'data.weights={alpha: 1, beta: 1}'")
    point_shipped_corpora_at(tmp_path, monkeypatch)
    run = ("data=mixture", "data.weights=null", "data.epochs={wikitext2: 1, glue_texts: 3}")
    with pytest.raises(ConfigError, match="draws a mixture's sources by weight") as checked:
        check_config(compose_pretrain(*run, "datamodule.streaming=true"))
    fix = str(checked.value).split("e.g. ")[1]
    plan = check_config(compose_pretrain(*run, "datamodule.streaming=true", *shlex.split(fix)))
    assert plan.corpus.spec()["by"] == "weights"  # the pasted fix passes the check


def test_a_source_that_makes_no_row_fails_at_setup_named_however_seldom_drawn(
    make_dm, sources, tmp_path
):
    """A BERT source of one-sentence documents makes no sentence pair. At a weight that the
    first step does not draw, the run still fails before it starts, naming the source (it
    failed only when first drawn, inside a loader worker)."""
    lines = [f"Line number {i} stands alone without another." for i in range(40)]
    (tmp_path / "gamma.txt").write_text("\n\n".join(lines) + "\n")
    corpora = {n: TextFilesCorpus(str(sources / f"{n}.txt"), doc_split="blank_line") for n in NAMES}
    corpora["gamma"] = TextFilesCorpus(str(tmp_path / "gamma.txt"), doc_split="blank_line")
    weights = {"alpha": 0.7, "beta": 0.3, "gamma": 0.001}
    dm = make_dm("bert", corpus=MixtureCorpus(corpora, weights=weights))
    stream = dm.stream
    [drawn] = step_rows(SEED, 0, 0, stream.weights, dm.objective.batch_size, stream.micro_batches)
    assert drawn[2] == 0  # the first step reads nothing of gamma
    with pytest.raises(DataSetupError, match=r"^data\.sources\.gamma: .*no BERT sentence pair"):
        dm.check_documents()
