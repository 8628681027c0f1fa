"""Task texts as a pretraining corpus (`data=glue_texts`) and corpora read one after another
(`data=wikitext2_glue_texts`), on small synthetic files laid out as the GLUE configs read them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate

from datamodules.corpora.corpus import ConcatCorpus, CorpusError, TextFilesCorpus
from datamodules.tasks.files import task_examples
from datamodules.tasks.spec import CARVED_DEV, TaskSpec
from datamodules.tasks.texts import TaskTextsCorpus
from tests.conftest import compose_pretrain
from tests.pipeline.task_data import write_task_split, write_task_texts


@pytest.fixture
def glue_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "glue"
    monkeypatch.setenv("GLUE_DIR", str(folder))
    return folder


def _glue_texts(*overrides: str):
    """The composed `data` node of `data=glue_texts` (with `overrides`)."""
    return compose_pretrain("data=glue_texts", *overrides).data


def _specs(node) -> dict[str, TaskSpec]:
    return {name: instantiate(task) for name, task in node.tasks.items()}


def test_glue_texts_reads_every_training_text_and_nothing_scored(glue_dir):
    node = _glue_texts()
    written = {name: write_task_texts(spec) for name, spec in _specs(node).items()}
    assert set(written) == {"sst2", "mrpc", "stsb", "cola", "rte"}
    corpus = instantiate(node)
    lines = [line for doc in corpus.documents() for line in doc.split("\n")]
    assert sorted(lines) == sorted(t for w in written.values() for t in w["train"])
    assert not {t for w in written.values() for t in w["dev"]} & set(lines)
    assert "sst2, mrpc, stsb, cola, rte" in corpus.describe()


def test_documents_are_one_pair_or_a_group_of_single_texts(glue_dir):
    node = _glue_texts("data.texts_per_document=3")
    specs = _specs(node)
    for spec in specs.values():
        write_task_texts(spec)
    docs = list(TaskTextsCorpus({n: specs[n] for n in ("cola", "rte")}, 3).documents())
    cola = [d.split("\n") for d in docs if d.startswith("cola")]
    rte = [d.split("\n") for d in docs if d.startswith("rte")]
    assert [len(d) for d in cola] == [3, 3, 1]  # 7 single texts, 3 per document, in file order
    assert cola[0] == ["cola train 0 a", "cola train 1 a", "cola train 2 a"]
    assert rte[0] == ["rte train 0 a", "rte train 0 b"] and len(rte) == 7  # a pair per document
    assert instantiate(node).texts_per_document == 3


def test_a_carved_out_dev_split_is_not_read(tmp_path):
    spec = TaskSpec(
        name="mine",
        data_dir=str(tmp_path),
        text_columns=["text"],
        label_column="label",
        files={"train": "train.tsv"},
        labels=["0", "1"],
        dev_fraction=0.5,
    )
    written = write_task_texts(spec, n_train=20, n_dev=0)["train"]
    read = {line for doc in TaskTextsCorpus({"mine": spec}).documents() for line in doc.split("\n")}
    carved = {e.texts[0] for e in task_examples(spec, CARVED_DEV)}
    assert len(read) == 10 and len(carved) == 10
    assert read | carved == set(written) and not read & carved


def test_fingerprint_follows_training_texts_and_settings_not_dev_files(glue_dir):
    node = _glue_texts()
    specs = _specs(node)
    for spec in specs.values():
        write_task_texts(spec)
    base = instantiate(node).fingerprint()
    assert instantiate(node).fingerprint() == base
    assert instantiate(_glue_texts("data.texts_per_document=4")).fingerprint() != base
    write_task_split(specs["rte"], "dev", [(("other", "dev text"), "entailment")])
    assert instantiate(node).fingerprint() == base  # a dev file is never read
    write_task_split(specs["rte"], "train", [(("other", "train text"), "entailment")])
    assert instantiate(node).fingerprint() != base
    fewer = TaskTextsCorpus({n: s for n, s in specs.items() if n != "sst2"})
    assert fewer.fingerprint() != instantiate(node).fingerprint()
    # every task setting that changes what is read changes the key
    for key, value in [("has_header", True), ("skip_bad_rows", True), ("format", "csv")]:
        changed = _glue_texts(f"++data.tasks.cola.{key}={value}")
        assert instantiate(changed).fingerprint() != instantiate(node).fingerprint(), key


def test_missing_training_file_names_it_and_the_fix(glue_dir):
    node = _glue_texts()
    with pytest.raises(Exception, match=r"task sst2: training file .*SST-2/train\.tsv"):
        instantiate(node)
    with pytest.raises(CorpusError, match="GLUE_DIR"):
        TaskTextsCorpus(_specs(node))
    with pytest.raises(CorpusError, match="names no task"):
        TaskTextsCorpus({})
    with pytest.raises(CorpusError, match="texts_per_document=0"):
        TaskTextsCorpus(_specs(node), 0)


def test_wikitext_then_task_texts(glue_dir, tmp_path, monkeypatch):
    wiki = tmp_path / "wikitext"
    wiki.mkdir()
    (wiki / "train.txt").write_text(" = First = \n one text .\n = Second = \n two text .\n")
    monkeypatch.setenv("WIKITEXT2_DIR", str(wiki))
    node = compose_pretrain("data=wikitext2_glue_texts").data
    for task in node.parts.glue_texts.tasks.values():
        write_task_texts(instantiate(task))
    corpus = instantiate(node)
    assert isinstance(corpus, ConcatCorpus)
    assert [type(p) for p in corpus.parts] == [TextFilesCorpus, TaskTextsCorpus]
    docs = list(corpus.documents())
    assert docs[:2] == ["= First =\none text .", "= Second =\ntwo text ."]
    assert docs[2].startswith("sst2 train 0 a") and docs[-1] == "rte train 6 a\nrte train 6 b"
    assert "+ training texts of task(s)" in corpus.describe()
    base = corpus.fingerprint()
    assert base not in {p.fingerprint() for p in corpus.parts}
    (wiki / "train.txt").write_text(" = First = \n one changed text .\n")
    assert instantiate(node).fingerprint() != base
    with pytest.raises(CorpusError, match="data.parts is empty"):
        ConcatCorpus([])
