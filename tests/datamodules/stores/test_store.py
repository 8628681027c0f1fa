import json
import threading
import time

import numpy as np
import pytest
from omegaconf import OmegaConf
from tokenizers import AddedToken, Tokenizer

from datamodules.corpora.corpus import CorpusError
from datamodules.corpora.sentences import split_sentences
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.run_stores import prepare_stores, store_settings
from datamodules.stores.build import open_or_build_store
from datamodules.stores.encoding import SENTENCE_MARK, _joined, _splits_alike
from datamodules.stores.store import (
    DOCUMENTS,
    MANIFEST,
    TOKENS,
    StoreInvalidError,
    StoreSettings,
    TokenStore,
    store_dir,
    store_key,
    token_dtype,
    tokenizer_hash,
)
from pipeline.pretrain.checks import check_config
from tests.composed_configs import composed_pretrain
from tests.conftest import CONF, ListCorpus
from tokenizer import get_tokenizer, special_ids, tokenizer_cache_path

BERT = StoreSettings(sentences=True)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_bert_store_holds_every_sentence(bert_store, embedded, wordpiece):
    documents = list(embedded.documents())
    assert bert_store.num_documents == len(documents)
    assert bert_store.tokens.dtype == np.uint16
    for index in (0, 7, len(documents) - 1):
        expected = [encode(wordpiece, s) for s in split_sentences(documents[index])]
        assert [s.tolist() for s in bert_store.sentences(index)] == [e for e in expected if e]
    assert bert_store.doc_offsets[-1] == bert_store.num_tokens == len(bert_store.tokens)


def test_sentence_store_equals_encoding_each_sentence_alone(wordpiece, tmp_path, small_docs):
    """Documents are encoded whole with a marker between sentences; the store must hold exactly
    what encoding each sentence alone gives, for documents that hold the marker character, a
    sentence that encodes to nothing (first, middle or last), blank documents and [SEP] text."""
    encoder = Tokenizer.from_str(wordpiece.to_str())
    encoder.encode_special_tokens = True
    long_document = " ".join(f"Sentence {i} of a long document." for i in range(2000))
    docs = [
        small_docs[0],
        f"A marker {SENTENCE_MARK} inside. Its sentences are encoded apart.",
        "\u200b.\nMiddle one. \u200b. Then [SEP] text.\n\u200b",
        "\u200b\nA b.\n\u200b\nC d.",  # empty sentences first and in the middle
        "   ",
        long_document,  # > 32k characters: several joined texts
        small_docs[1],
        "One sentence only",
    ]
    # chunk_mb small enough that the documents span several chunks
    store, stats = open_or_build_store(ListCorpus(docs), wordpiece, BERT, tmp_path, chunk_mb=1e-4)
    expected = []
    for doc in docs:
        sentences = [encode(encoder, s) for s in split_sentences(doc)]
        if sentences := [s for s in sentences if s]:
            expected.append(sentences)
    assert stats.skipped_documents == 1
    assert store.num_documents == len(expected)
    for index, sentences in enumerate(expected):
        assert [s.tolist() for s in store.sentences(index)] == sentences
    assert wordpiece.get_vocab_size() not in store.tokens  # no marker id left


def test_tokenizers_that_treat_the_first_split_apart_encode_sentence_by_sentence(
    wordpiece, tmp_path
):
    """Metaspace with prepend_scheme="first" marks only the text's first word: joining sentences
    would change the others, so such a tokenizer's sentences are encoded one by one."""
    spec = json.loads(wordpiece.to_str())
    spec["pre_tokenizer"] = {
        "type": "Metaspace",
        "replacement": "\u2581",
        "prepend_scheme": "first",
        "split": True,
    }
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    assert not _splits_alike(tokenizer) and _splits_alike(wordpiece)
    spec["pre_tokenizer"]["prepend_scheme"] = "always"
    assert _splits_alike(Tokenizer.from_str(json.dumps(spec)))
    docs = ["First sentence here. Second one there. Third at last.", "Only one sentence."]
    store, _ = open_or_build_store(ListCorpus(docs), tokenizer, BERT, tmp_path)
    for index, doc in enumerate(docs):
        expected = [encode(tokenizer, s) for s in split_sentences(doc)]
        assert [s.tolist() for s in store.sentences(index)] == expected


def test_marker_character_in_the_vocabulary_stays_text(wordpiece, tmp_path):
    """A tokenizer that already knows the marker character as a token: the marker maps to that
    id, and a document containing the character must still keep it as a token."""
    tokenizer = Tokenizer.from_str(wordpiece.to_str())
    tokenizer.add_tokens([AddedToken(SENTENCE_MARK, normalized=False)])
    plain = [f"Alpha beta {SENTENCE_MARK} gamma. Delta epsilon.", "Alpha beta. Gamma delta."]
    store, _ = open_or_build_store(ListCorpus(plain), tokenizer, BERT, tmp_path)
    for index, doc in enumerate(plain):
        expected = [encode(tokenizer, s) for s in split_sentences(doc)]
        assert [s.tolist() for s in store.sentences(index)] == expected
    assert tokenizer.token_to_id(SENTENCE_MARK) in store.sentences(0)[0]


def test_gpt_store_ends_documents_with_eos(gpt_store, embedded, bpe):
    eos = special_ids(bpe).eot
    documents = list(embedded.documents())
    for index in (0, 40):
        assert gpt_store.document(index).tolist() == [*encode(bpe, documents[index]), eos]
    assert (gpt_store.tokens == eos).sum() == gpt_store.num_documents


def test_second_open_reuses_the_store(wordpiece, tmp_path, small_docs):
    corpus = ListCorpus(small_docs)
    store, stats = open_or_build_store(corpus, wordpiece, BERT, tmp_path)
    assert stats.built and corpus.reads == 1
    again, stats2 = open_or_build_store(corpus, wordpiece, BERT, tmp_path)
    assert not stats2.built and corpus.reads == 1  # not re-read, not re-tokenized
    assert again.path == store.path and stats2.tokens == stats.tokens
    assert np.array_equal(again.tokens, store.tokens)


@pytest.mark.parametrize(
    "damage",
    ["truncate_tokens", "flip_byte", "drop_manifest", "garble_manifest", "delete_offsets"],
)
def test_damaged_store_is_rebuilt_never_read(damage, wordpiece, tmp_path, small_docs):
    corpus = ListCorpus(small_docs)
    store, _ = open_or_build_store(corpus, wordpiece, BERT, tmp_path)
    reference = np.array(store.tokens)
    path = store.path
    if damage == "truncate_tokens":
        with open(path / TOKENS, "r+b") as handle:
            handle.truncate(len(reference))  # half the bytes of a uint16 array
    elif damage == "flip_byte":
        data = bytearray((path / TOKENS).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (path / TOKENS).write_bytes(bytes(data))
    elif damage == "drop_manifest":  # as if the build was interrupted before the end
        (path / MANIFEST).unlink()
    elif damage == "garble_manifest":
        (path / MANIFEST).write_text("{not json")
    else:
        (path / DOCUMENTS).unlink()
    with pytest.raises(StoreInvalidError):
        TokenStore.open(path)
    rebuilt, stats = open_or_build_store(corpus, wordpiece, BERT, tmp_path)
    assert stats.built and corpus.reads == 2
    assert np.array_equal(rebuilt.tokens, reference)
    TokenStore.open(path)  # valid again


def test_cache_key_follows_corpus_tokenizer_and_settings(wordpiece, bpe, small_docs, tmp_path):
    corpus = ListCorpus(small_docs)
    base = store_key(corpus.fingerprint(), tokenizer_hash(wordpiece), BERT)
    assert base == store_key(corpus.fingerprint(), tokenizer_hash(wordpiece), BERT)
    others = {
        store_key(ListCorpus(small_docs[1:]).fingerprint(), tokenizer_hash(wordpiece), BERT),
        store_key(corpus.fingerprint(), tokenizer_hash(bpe), BERT),
        store_key(corpus.fingerprint(), tokenizer_hash(wordpiece), StoreSettings(False, 1)),
    }
    assert base not in others and len(others) == 3
    assert store_dir(tmp_path, base).parent == tmp_path / "token_stores"


def test_cache_key_follows_the_tokenizers_version(wordpiece, monkeypatch):
    """The library that encodes is part of the key: a new minor version may split differently."""
    import tokenizers

    key = store_key("corpus", tokenizer_hash(wordpiece), BERT)
    monkeypatch.setattr(tokenizers, "__version__", tokenizers.__version__ + "1")
    assert store_key("corpus", tokenizer_hash(wordpiece), BERT) == key  # a patch release
    monkeypatch.setattr(tokenizers, "__version__", "0.0.1")
    assert store_key("corpus", tokenizer_hash(wordpiece), BERT) != key


def test_vocabulary_decides_token_width():
    assert token_dtype(30522) == np.uint16
    assert token_dtype(1 << 16) == np.uint16
    assert token_dtype(50304 * 3) == np.uint32


def test_empty_corpus_is_an_error(wordpiece, tmp_path):
    with pytest.raises(CorpusError, match="yielded no text"):
        open_or_build_store(ListCorpus([]), wordpiece, BERT, tmp_path)
    with pytest.raises(CorpusError, match="2 empty documents"):
        open_or_build_store(ListCorpus([" ", "\u200b"]), wordpiece, BERT, tmp_path)
    assert not list((tmp_path / "token_stores").glob("*/" + MANIFEST))


def test_documents_without_text_are_skipped_and_counted(wordpiece, tmp_path, small_docs):
    docs = [small_docs[0], "  \n \u200b ", small_docs[1], ""]
    store, stats = open_or_build_store(ListCorpus(docs), wordpiece, BERT, tmp_path)
    assert stats.documents == store.num_documents == 2
    assert stats.skipped_documents == 2
    assert json.loads((store.path / MANIFEST).read_text())["counts"]["skipped_documents"] == 2


def test_special_token_text_is_encoded_as_text(wordpiece, bpe, tmp_path):
    text = "The [SEP] and [MASK] strings and <|endoftext|> are only text here."
    for tokenizer, objective in ((wordpiece, MaskedLMObjective()), (bpe, CausalLMObjective())):
        settings = store_settings(objective, tokenizer)
        store, _ = open_or_build_store(ListCorpus([text, text]), tokenizer, settings, tmp_path)
        specials = special_ids(tokenizer).all() - {special_ids(tokenizer).unk}
        body = store.document(0)[:-1] if settings.eos_id is not None else store.document(0)
        assert not set(body.tolist()) & specials
        assert tokenizer.encode(text).ids != body.tolist()  # the tokenizer alone would not


def test_waiting_rank_reads_after_the_builder(wordpiece, tmp_path, small_docs):
    corpus = ListCorpus(small_docs)
    result = {}

    def waiter():
        result["store"], result["stats"] = open_or_build_store(
            corpus, wordpiece, BERT, tmp_path, may_build=False, poll_s=0.05
        )

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # nothing to read yet
    built, _ = open_or_build_store(corpus, wordpiece, BERT, tmp_path)
    thread.join(timeout=30)
    assert not result["stats"].built and corpus.reads == 1  # only the builder read the corpus
    assert np.array_equal(result["store"].tokens, built.tokens)


def test_waiting_rank_times_out_with_a_clear_error(wordpiece, tmp_path, small_docs):
    with pytest.raises(StoreInvalidError, match=r"waited 0 s for rank 0.*make prepare"):
        open_or_build_store(
            ListCorpus(small_docs), wordpiece, BERT, tmp_path, may_build=False, wait_timeout_s=0
        )


def test_store_pickles_as_its_path(bert_store):
    import pickle

    payload = pickle.dumps(bert_store)
    assert len(payload) < 10_000  # the memory maps are not copied
    clone = pickle.loads(payload)
    assert np.array_equal(clone.tokens[:1000], bert_store.tokens[:1000])


def test_prepare_stores_reports_figures(embedded, wordpiece, tmp_path, small_docs):
    stats = prepare_stores(
        embedded,
        wordpiece,
        MaskedLMObjective(),
        tmp_path,
        val_corpus=ListCorpus(small_docs[:5]),
    )
    assert [s.built for s in stats] == [True, True]
    train = stats[0]
    assert train.documents == 79 and train.tokens > 50_000 and train.mb_per_s > 0
    assert train.text_bytes > 300_000
    assert "documents" in train.summary() and str(train.path) in train.summary()
    assert not prepare_stores(embedded, wordpiece, MaskedLMObjective(), tmp_path)[0].built


def test_real_wikitext2_store(wiki_gpt_store, wikitext, bpe):
    assert wiki_gpt_store.num_documents == 629  # articles of the tokenized train split
    assert wiki_gpt_store.num_tokens > 2_000_000
    first = next(iter(wikitext.documents()))
    assert bpe.decode(wiki_gpt_store.document(0)[:-1].tolist()) == first


def test_long_documents_are_joined_into_several_texts_at_sentence_boundaries():
    sentences = [f"Sentence {i} " + "x" * 90 for i in range(1000)]
    texts = _joined(sentences)
    assert len(texts) == 4 and all(len(t) < 33_000 for t in texts)
    assert [s for t in texts for s in t.split(SENTENCE_MARK)] == sentences
    assert _joined([]) == [] and _joined(["One."]) == ["One."]


# A run's caches as the config decides them: each case overrides the base run (`model=bert` or
# `model=gpt` on a JSONL corpus) and says whether the tokenizer must be retrained (a new tokenizer
# cache key) and the corpus re-tokenized (a new store). Every setting of conf/tokenizer/*.yaml and
# conf/objective/*.yaml appears in some case.
CACHE_CASES = [
    ("bert", ["data.errors=skip"], True, True),
    ("bert", ["data.text_field=body"], True, True),
    ("bert", ["data.paths={other}"], True, True),
    ("bert", ["data.paths={same}"], False, False),
    # these small files are hashed under the default `auto` too: the same caches
    ("bert", ["data.change_detection=content"], False, False),
    ("bert", ["tokenizer.vocab_size=500"], True, True),
    ("bert", ["tokenizer.min_frequency=30"], True, True),
    ("bert", ["tokenizer.lowercase=false"], True, True),
    ("bert", ["tokenizer.path={tokenizer}"], False, False),  # the same tokenizer, loaded
    ("bert", ["model=gpt", "tokenizer.kind=bpe"], True, True),
    ("gpt", ["tokenizer.vocab_size=500"], True, True),
    ("gpt", ["tokenizer.lowercase=true"], False, False),  # byte-level BPE never normalizes
    ("gpt", ["tokenizer.path={tokenizer}"], False, False),
    ("gpt", ["tokenizer.sample_mb=0.0001"], True, True),  # trained on the first document only
    ("bert", ["objective.seq_len=64"], False, False),
    ("bert", ["objective.batch_size=8"], False, False),
    ("bert", ["objective.mlm_probability=0.3"], False, False),
    ("bert", ["objective.mask_replace_prob=0.5"], False, False),
    ("bert", ["objective.random_replace_prob=0.2"], False, False),
    ("bert", ["objective.max_predictions_per_seq=5"], False, False),
    ("bert", ["objective.next_sentence_prediction=false"], False, False),
    ("bert", ["objective.short_seq_prob=0.5"], False, False),
    ("bert", ["objective.whole_word_masking=true"], False, False),
    # both phases' batches come from one store (braces doubled: the overrides are formatted)
    ("bert", ["objective.phases=[{{share:0.5}},{{share:0.5,seq_len:512}}]"], False, False),
    ("gpt", ["objective.phases=[{{share:0.5,seq_len:64}},{{share:0.5}}]"], False, False),
    ("gpt", ["objective.seq_len=64"], False, False),
    ("gpt", ["objective.batch_size=4"], False, False),
    ("gpt", ["objective.document_masking=true"], False, False),
    ("bert", ["seed=7", "trainer.max_steps=9", "optim.lr=0.01", "model.n_layers=1"], False, False),
    ("bert", ["datamodule.val_fraction=0.3", "trainer.accumulate_grad_batches=2"], False, False),
]


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory, small_docs) -> dict[str, str]:
    """JSONL files of 31 records, one with a byte that is not UTF-8 (dropped by
    data.errors=skip, U+FFFD with replace), and the `paths` patterns the cases use."""
    folder = tmp_path_factory.mktemp("jsonl")
    lines = [
        json.dumps({"text": doc[:1500], "body": doc[1500:3000] or "short"}).encode()
        for doc in small_docs
    ]
    lines.insert(7, b'{"text": "a record with a bad \xff byte.", "body": "bad \xff"}')
    (folder / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (folder / "b.jsonl").write_bytes(b"\n".join(lines[::-1][:20]) + b"\n")
    return {
        "base": str(folder / "a.jsonl"),
        "other": str(folder / "b.jsonl"),
        "same": str(folder / "[a].jsonl"),
    }


def run_caches(cache, paths: dict[str, str], base: str, overrides: list[str]):
    """(tokenizer cache path, store stats) of the run `model=<base>` + `overrides`, as
    `make prepare` makes them (the base run's config, the same for every case, is composed
    once)."""
    cfg = composed_pretrain(
        f"model={base}",
        "data=jsonl",
        f"data.paths=['{paths['base']}']",
        "data.errors=replace",
        "tokenizer.vocab_size=400",
        *overrides,
    )
    plan = check_config(cfg)
    tokenizer = get_tokenizer(plan.tokenizer, plan.corpus, cache)
    [stats] = prepare_stores(plan.corpus, tokenizer, plan.objective, cache)
    return tokenizer_cache_path(plan.tokenizer, plan.corpus, cache), stats


def test_every_cache_case_is_listed():
    """A new tokenizer or objective setting must be classified in CACHE_CASES."""
    named = {o.split("=")[0] for _, overrides, _, _ in CACHE_CASES for o in overrides}
    for group in ("tokenizer", "objective"):
        for path in (CONF / group).glob("*.yaml"):
            keys = {f"{group}.{k}" for k in OmegaConf.load(path) if k != "_target_"}
            assert keys <= named, f"{path.name}: add a case for {sorted(keys - named)}"


@pytest.mark.parametrize(("base", "overrides", "retrains", "rebuilds"), CACHE_CASES)
def test_a_setting_rebuilds_the_caches_exactly_when_it_changes_the_tokens(
    base, overrides, retrains, rebuilds, jsonl_corpus, tmp_path_factory
):
    cache = tmp_path_factory.getbasetemp() / "run-caches"  # shared: the base run is built once
    base_tokenizer, base_store = run_caches(cache, jsonl_corpus, base, [])
    values = {"other": f"['{jsonl_corpus['other']}']", "same": f"['{jsonl_corpus['same']}']"}
    overrides = [o.format(tokenizer=base_tokenizer, **values) for o in overrides]
    tokenizer_path, store = run_caches(cache, jsonl_corpus, base, overrides)
    assert (tokenizer_path != base_tokenizer) == retrains
    assert (store.path != base_store.path) == rebuilds
    if not rebuilds:
        assert not store.built  # reused, not rebuilt in place


def test_errors_setting_of_a_jsonl_corpus_gets_its_own_store(jsonl_corpus, tmp_path):
    """The reported case: a data.errors=skip run reused the errors=replace store."""
    _, replaced = run_caches(tmp_path, jsonl_corpus, "bert", [])
    _, skipped = run_caches(tmp_path, jsonl_corpus, "bert", ["data.errors=skip"])
    assert (replaced.documents, skipped.documents) == (31, 30)
    assert skipped.built and skipped.path != replaced.path
