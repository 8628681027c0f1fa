import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

import datamodules.corpora.corpus as corpus_module
from datamodules.corpora.corpus import (
    CorpusError,
    EmbeddedCorpus,
    JsonlCorpus,
    ParquetCorpus,
    TextFilesCorpus,
)
from tests.conftest import CONF


def test_embedded_corpus_is_real_prose():
    docs = list(EmbeddedCorpus().documents())
    assert 70 <= len(docs) <= 100
    assert 300_000 < sum(len(d) for d in docs) < 600_000
    assert sum("\n" in d for d in docs) > 0.8 * len(docs)  # paragraphs within documents
    assert EmbeddedCorpus().fingerprint() == EmbeddedCorpus().fingerprint()
    assert EmbeddedCorpus(min_chars=10).fingerprint() != EmbeddedCorpus().fingerprint()


def test_text_files_doc_split_modes(tmp_path):
    (tmp_path / "a.txt").write_text("first doc line one\nline two\n\n\nsecond doc\n")
    with gzip.open(tmp_path / "b.txt.gz", "wt") as handle:
        handle.write("third doc\n")
    pattern = str(tmp_path / "*.txt*")
    assert list(TextFilesCorpus(pattern, doc_split="blank_line").documents()) == [
        "first doc line one\nline two",
        "second doc",
        "third doc",
    ]
    assert list(TextFilesCorpus(pattern, doc_split="file").documents()) == [
        "first doc line one\nline two\nsecond doc",
        "third doc",
    ]


def test_wikitext_articles(tmp_path):
    (tmp_path / "w.txt").write_text(
        " = Alpha = \n\n Alpha text .\n\n = = Section = = \n\n more alpha .\n = Beta = \n beta .\n"
    )
    docs = list(TextFilesCorpus([str(tmp_path / "w.txt")], doc_split="wikitext").documents())
    assert len(docs) == 2
    assert docs[0].startswith("= Alpha =") and "= = Section = =" in docs[0]
    assert docs[1] == "= Beta =\nbeta ."


def test_fingerprint_follows_content(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one\n")
    before = TextFilesCorpus(str(path)).fingerprint()
    path.write_text("one, changed\n")
    assert TextFilesCorpus(str(path)).fingerprint() != before
    assert (
        TextFilesCorpus(str(path), doc_split="file").fingerprint()
        != TextFilesCorpus(str(path)).fingerprint()
    )


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(CorpusError, match="matches no file"):
        TextFilesCorpus(str(tmp_path / "*.txt"))
    with pytest.raises(CorpusError, match="empty"):
        TextFilesCorpus([])


def test_invalid_utf8_reports_file_and_offset(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"good line\nbad \xff byte\nlast\n")
    with pytest.raises(CorpusError, match=r"bad.txt: invalid UTF-8 at byte offset 14"):
        list(TextFilesCorpus(str(path)).documents())
    assert list(TextFilesCorpus(str(path), errors="replace").documents()) == [
        "good line\nbad \ufffd byte\nlast"
    ]
    assert list(TextFilesCorpus(str(path), errors="skip").documents()) == ["good line\nlast"]


def test_bad_settings_named():
    with pytest.raises(CorpusError, match="data.doc_split"):
        TextFilesCorpus(["x"], doc_split="sentences")
    with pytest.raises(CorpusError, match="data.errors"):
        TextFilesCorpus(["x"], errors="ignore")


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"body": "doc one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    assert list(JsonlCorpus(str(path), text_field="body").documents()) == ["doc one", "two"]
    with pytest.raises(CorpusError, match=r"d.jsonl:1: record has no field 'text'.*body"):
        list(JsonlCorpus(str(path)).documents())
    path.write_text("{broken\n")
    with pytest.raises(CorpusError, match="d.jsonl:1: not valid JSON"):
        list(JsonlCorpus(str(path), text_field="body").documents())


def test_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["a doc", "", "another"], "n": [1, 2, 3]}), path)
    corpus = ParquetCorpus(str(path), text_field="content", batch_rows=2)
    assert list(corpus.documents()) == ["a doc", "another"]
    with pytest.raises(CorpusError, match="no column 'text'"):
        list(ParquetCorpus(str(path)).documents())


def test_real_wikitext2_articles(shared_data):
    corpus = TextFilesCorpus(
        str(shared_data / "wikitext/wikitext-2-raw/wiki.valid.raw"), doc_split="wikitext"
    )
    docs = list(corpus.documents())
    assert len(docs) == 60  # SOURCES.md: 60 articles in the validation split
    assert all(d.startswith("= ") for d in docs)


def test_hf_dataset_loaded_once_and_regrouped_into_articles(monkeypatch):
    import datasets

    from datamodules.corpora.corpus import HFDatasetCorpus

    rows = [" = Alpha = \n", " alpha text .\n", "", " = = Part = = \n", " = Beta = \n", " beta .\n"]
    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"text": rows})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    corpus = HFDatasetCorpus(name="wikitext", config="wikitext-103-raw-v1", split="train")
    assert list(corpus.documents()) == ["= Alpha =\nalpha text .\n= = Part = =", "= Beta =\nbeta ."]
    assert corpus.fingerprint() == corpus.fingerprint()
    assert calls == [("wikitext", "wikitext-103-raw-v1", "train")]  # one load serves all


def test_hf_dataset_load_failure_is_a_clear_error(monkeypatch):
    import datasets

    from datamodules.corpora.corpus import HFDatasetCorpus

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(CorpusError, match="could not load Hugging Face dataset 'wikitext'"):
        HFDatasetCorpus().fingerprint()


# Every setting of every conf/data/*.yaml: values that differ from the file's, each with whether it
# changes the documents read (and so must change the fingerprint, which keys the tokenizer and
# token-store caches). `OTHER` is another file of the same kind, `SAME` the config's file matched by
# another pattern. A setting added to a YAML file fails the test until it is classified here.
OTHER, SAME = object(), object()
# `change_detection` reads the same text; on these small files `auto` hashes the bytes as
# `content` does, and `stat` identifies them by mtime instead: another key (one rebuild), never
# a stale reuse.
CHANGE_DETECTION = [("content", False), ("stat", True)]
SETTING_CHANGES = {
    "embedded": {"min_chars": [(80, True)]},
    "text_files": {
        "paths": [(OTHER, True), (SAME, False)],
        "doc_split": [("file", True), ("wikitext", True)],
        "errors": [("replace", True), ("skip", True)],
        "change_detection": CHANGE_DETECTION,
    },
    "wikitext2": {
        "paths": [(OTHER, True), (SAME, False)],
        "doc_split": [("blank_line", True), ("file", True)],
        "errors": [("replace", True), ("skip", True)],
        "change_detection": CHANGE_DETECTION,
    },
    "jsonl": {
        "paths": [(OTHER, True), (SAME, False)],
        "text_field": [("body", True)],
        "errors": [("replace", True), ("skip", True)],
        "change_detection": CHANGE_DETECTION,
    },
    "parquet": {
        "paths": [(OTHER, True), (SAME, False)],
        "text_field": [("body", True)],
        "batch_rows": [(7, False)],
        "row_groups": [((0,), True)],
        "change_detection": CHANGE_DETECTION,
    },
    "wikitext103": {
        "name": [("other", True)],
        "config": [("wikitext-2-raw-v1", True)],
        "split": [("validation", True)],
        "text_field": [("body", True)],
        "doc_split": [("record", True)],
    },
}
# configs of a corpus class above, other files (the books, WikiText-2's test articles)
SETTING_CHANGES |= {
    "wikitext2_test": SETTING_CHANGES["wikitext2"],
    "gutenberg": SETTING_CHANGES["jsonl"],
    "gutenberg_valid": SETTING_CHANGES["jsonl"],
}


def _data_files(tmp_path, name: str) -> tuple[str, str]:
    """(the config's file, another file) of the kind data config `name` reads."""
    paths = []
    for stem in ("a", "b"):
        if name == "parquet":
            path = tmp_path / f"{stem}.parquet"
            pq.write_table(pa.table({"text": [f"{stem} text"], "body": [f"{stem} body"]}), path)
        elif name in ("jsonl", "gutenberg", "gutenberg_valid"):
            path = tmp_path / f"{stem}.jsonl"
            path.write_text(json.dumps({"text": f"{stem} text", "body": f"{stem} body"}) + "\n")
        else:
            path = tmp_path / f"{stem}.txt"
            path.write_text(f" = {stem} = \n {stem} text .\n")
        paths.append(str(path))
    return paths[0], paths[1]


def _fake_hf_datasets(monkeypatch) -> None:
    """`datasets.load_dataset` without network: one fixed dataset per (name, config, split)."""
    import datasets

    loaded = {}

    def load_dataset(name, config, split):
        key = (name, config, split)
        if key not in loaded:
            loaded[key] = datasets.Dataset.from_dict({"text": [str(key)], "body": ["b"]})
        return loaded[key]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


# The data configs composed of others (`defaults`: task configs, or other data configs) are
# covered by tests/datamodules/tasks/test_task_texts.py and test_mixture.py.
LEAF_DATA_CONFIGS = sorted(
    p.stem for p in (CONF / "data").glob("*.yaml") if "defaults" not in OmegaConf.load(p)
)


def test_composed_data_configs_are_the_task_text_ones():
    composed = {p.stem for p in (CONF / "data").glob("*.yaml")} - set(LEAF_DATA_CONFIGS)
    assert composed == {"glue_texts", "wikitext2_glue_texts", "mixture"}


@pytest.mark.parametrize("name", LEAF_DATA_CONFIGS)
def test_every_data_setting_that_changes_the_text_changes_the_fingerprint(
    name, tmp_path, monkeypatch
):
    node = OmegaConf.load(CONF / "data" / f"{name}.yaml")
    settings = {k for k in node if k != "_target_"}
    assert settings == set(SETTING_CHANGES[name]), (
        f"conf/data/{name}.yaml has settings {sorted(settings)}: classify each in SETTING_CHANGES"
    )
    _fake_hf_datasets(monkeypatch)
    mine, other = _data_files(tmp_path, name)
    given = {"paths": [mine]} if "paths" in settings else {}
    substitutes = {OTHER: [other], SAME: [mine.replace("/a.", "/[a].")]}

    def fingerprint(**changes) -> str:
        merged = OmegaConf.merge(node, given, changes)
        return instantiate(merged).fingerprint()

    base = fingerprint()
    assert fingerprint() == base
    wrong = []
    for key, options in SETTING_CHANGES[name].items():
        for value, changes_text in options:
            value = substitutes.get(value, value)
            if (fingerprint(**{key: value}) != base) != changes_text:
                wrong.append(f"{key}={value!r} should {'' if changes_text else 'not '}rebuild")
    assert not wrong, f"data={name}: " + "; ".join(wrong)


@pytest.mark.parametrize("suffix", ["txt", "jsonl", "parquet"])
def test_fingerprint_follows_file_content(tmp_path, suffix):
    corpus_type = {"txt": TextFilesCorpus, "jsonl": JsonlCorpus, "parquet": ParquetCorpus}[suffix]
    path = tmp_path / f"d.{suffix}"

    def write(text: str) -> None:
        if suffix == "parquet":
            pq.write_table(pa.table({"text": [text]}), path)
        else:
            path.write_text(json.dumps({"text": text}) + "\n" if suffix == "jsonl" else text)

    write("one")
    before = corpus_type(str(path)).fingerprint()
    write("one, changed")
    assert corpus_type(str(path)).fingerprint() != before


def test_jsonl_errors_setting_is_checked():
    with pytest.raises(CorpusError, match=r"data\.errors='ignore' is not one of strict"):
        JsonlCorpus(["x"], errors="ignore")


def _write_corpus_file(path, suffix: str, text: str) -> None:
    if suffix == "parquet":
        pq.write_table(pa.table({"text": [text]}), path)
    elif suffix == "jsonl":
        path.write_text(json.dumps({"text": text}) + "\n")
    else:
        path.write_text(text + "\n")


@pytest.mark.parametrize("suffix", ["txt", "jsonl", "parquet"])
def test_a_same_size_edit_with_the_mtime_restored_changes_the_content_fingerprint(tmp_path, suffix):
    """`cp -p` / `rsync -t` of an edited file: same size, same mtime, other bytes."""
    corpus_type = {"txt": TextFilesCorpus, "jsonl": JsonlCorpus, "parquet": ParquetCorpus}[suffix]
    path = tmp_path / f"d.{suffix}"

    def fingerprints() -> dict[str, str]:
        modes = ("auto", "content", "stat")
        return {m: corpus_type(str(path), change_detection=m).fingerprint() for m in modes}

    _write_corpus_file(path, suffix, "the cat sat on the mat")
    before, times = fingerprints(), path.stat()
    _write_corpus_file(path, suffix, "the cat sat on the hat")
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert path.stat().st_size == times.st_size and path.stat().st_mtime_ns == times.st_mtime_ns
    after = fingerprints()
    assert after["stat"] == before["stat"]  # the documented blind spot of `stat`
    assert after["content"] != before["content"]
    assert after["auto"] != before["auto"]  # a small corpus is hashed
    assert before["auto"] == before["content"] != before["stat"]


def test_stat_fingerprint_is_the_one_from_before_the_setting_existed(tmp_path):
    """`change_detection` is not in the key, so caches keyed by stat are not rebuilt."""
    from datamodules.corpora.fingerprint import _hash

    path = tmp_path / "a.txt"
    path.write_text("some text\n")
    st = path.stat()
    settings = {"doc_split": "blank_line", "errors": "strict"}
    before = _hash("TextFilesCorpus", settings, [[str(path), st.st_size, st.st_mtime_ns]])
    assert TextFilesCorpus(str(path), change_detection="stat").fingerprint() == before


def test_auto_stats_files_beyond_the_limit_and_hashes_each_file_once_per_corpus(
    tmp_path, monkeypatch
):
    import datamodules.corpora.fingerprint as fingerprint_module

    (tmp_path / "a.txt").write_text("a" * 100 + "\n")
    (tmp_path / "b.txt").write_text("b" * 100 + "\n")
    pattern = str(tmp_path / "*.txt")
    reads = []
    digest = fingerprint_module._file_digest
    monkeypatch.setattr(fingerprint_module, "_file_digest", lambda p: reads.append(p) or digest(p))
    corpus = TextFilesCorpus(pattern)
    assert corpus.fingerprint() == corpus.fingerprint() == corpus.fingerprint()
    assert len(reads) == 2  # the fingerprints a run takes read each file once
    assert (
        corpus.fingerprint() == TextFilesCorpus(pattern, change_detection="content").fingerprint()
    )
    monkeypatch.setattr(fingerprint_module, "AUTO_CONTENT_LIMIT", 201)  # the two files total 202
    stat = TextFilesCorpus(pattern, change_detection="stat").fingerprint()
    assert TextFilesCorpus(pattern).fingerprint() == stat


def test_change_detection_setting_is_checked(tmp_path):
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(CorpusError, match=r"data\.change_detection='hash' is not one of auto"):
        TextFilesCorpus(str(tmp_path / "a.txt"), change_detection="hash")


def test_damaged_gzip_and_parquet_files_are_corpus_errors(tmp_path):
    plain = tmp_path / "plain.txt.gz"
    plain.write_text("plain text, not gzip\n")
    with pytest.raises(CorpusError, match=r"plain\.txt\.gz: not a readable gzip file"):
        list(TextFilesCorpus(str(plain)).documents())
    truncated = tmp_path / "cut.txt.gz"
    truncated.write_bytes(gzip.compress(os.urandom(5000).hex().encode())[:1000])
    with pytest.raises(CorpusError, match=r"cut\.txt\.gz: not a readable gzip file"):
        list(TextFilesCorpus(str(truncated)).documents())
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet\n")
    with pytest.raises(CorpusError, match=r"fake\.parquet: not a readable Parquet file"):
        list(ParquetCorpus(str(fake)).documents())
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    with pytest.raises(CorpusError, match=r"column 'text' holds int64, not text"):
        list(ParquetCorpus(str(numbers)).documents())


def test_a_gzip_stream_left_unfinished_closes_quietly_after_its_modules_are_gone(
    tmp_path, monkeypatch
):
    """At interpreter shutdown a stream left half-read is closed after module globals are
    cleared; closing it must not evaluate the damaged-file clause's names (once printed as
    "Exception ignored in _gzip_checked ... TypeError")."""
    shard = tmp_path / "a.txt.gz"
    shard.write_bytes(gzip.compress(b"one line\nanother line\n"))
    with gzip.open(shard, "rb") as handle:
        lines = corpus_module._gzip_checked(handle, str(shard))
        assert next(lines) == b"one line\n"
        monkeypatch.setattr(corpus_module, "gzip", None)  # as module teardown leaves it
        monkeypatch.setattr(corpus_module, "zlib", None)
        lines.close()  # raised AttributeError from the except clause before
