"""Weighted mixtures (datamodules/corpora/mixture.py): sampling by weight and by epochs, rows that never
mix sources, per-source validation, exact resume, reweighting refused, errors naming the source."""

from __future__ import annotations

import os
import random
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from hydra.utils import instantiate

from datamodules.corpora.corpus import CorpusError, DataSetupError, TextFilesCorpus
from datamodules.corpora.mixture import MixtureCorpus, resume_overrides, source_keys
from datamodules.objectives.batches import merge_batches
from datamodules.objectives.mixed import VAL_SOURCE, MixtureBatches, blend
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.pretrain import PretrainDataModule
from datamodules.run_stores import prepare_stores
from pipeline.pretrain.checks import check_config
from pipeline.run.errors import ConfigError
from tests.conftest import (
    REPO,
    ListCorpus,
    compose_pretrain,
    run_command,
    write_two_source_mixture,
)
from tests.pipeline.task_data import point_shipped_corpora_at
from tokenizer import batched, train_tokenizer

WORDS = {
    "alpha": [
        "apple",
        "apricot",
        "almond",
        "anchor",
        "arrow",
        "amber",
        "atlas",
        "axis",
        "acorn",
        "anvil",
    ],
    "beta": [
        "banana",
        "berry",
        "basil",
        "bridge",
        "button",
        "bottle",
        "branch",
        "breeze",
        "bucket",
        "barrel",
    ],
}


def documents(name: str, count: int, seed: int) -> list[str]:
    """`count` documents of 3-8 sentences made only of `WORDS[name]`."""
    rng = random.Random(seed)
    words = WORDS[name]
    docs = []
    for _ in range(count):
        sentences = [
            " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "."
            for _ in range(rng.randint(3, 8))
        ]
        docs.append(" ".join(sentences))
    return docs


@pytest.fixture(scope="module")
def sources() -> dict[str, ListCorpus]:
    # beta is three times smaller than alpha: weights far from the natural shares
    return {
        "alpha": ListCorpus(documents("alpha", 120, 1)),
        "beta": ListCorpus(documents("beta", 40, 2)),
    }


@pytest.fixture(scope="module", params=["wordpiece", "bpe"])
def tokenizer(request, sources):
    texts = [d for corpus in sources.values() for d in corpus.docs]
    return train_tokenizer(request.param, batched(iter(texts)), 300)


def objective_for(tokenizer):
    if tokenizer.token_to_id("[MASK]") is not None:
        return MaskedLMObjective(seq_len=32, batch_size=8)
    return CausalLMObjective(seq_len=16, batch_size=8)


def source_ids(tokenizer) -> dict[str, set[int]]:
    """The ids only one source's words encode to (punctuation is shared)."""
    ids = {}
    for name, words in WORDS.items():
        text = " ".join(w + " " + w.capitalize() + "." for w in words)
        ids[name] = set(tokenizer.encode(text, add_special_tokens=False).ids)
    shared = ids["alpha"] & ids["beta"]
    return {name: found - shared for name, found in ids.items()}


def row_sources(batch: dict, tokenizer) -> list[str]:
    """The source of every row of a batch, from its tokens; a row mixing sources fails."""
    ids = source_ids(tokenizer)
    names = []
    tokens = batch["targets"] if "targets" in batch else batch["input_ids"]
    labels = batch.get("mlm_labels")
    for row, values in enumerate(np.asarray(tokens)):
        seen = set(values.tolist())
        if labels is not None:  # masked positions hold [MASK] or random ids: read the labels
            width = tokens.shape[1]
            masked = np.asarray(batch["masked_positions"])
            mine = masked // width == row
            seen -= set(values[masked[mine] % width].tolist())
            seen |= set(np.asarray(labels)[mine].tolist())
        owners = {name for name, s in ids.items() if seen & s}
        assert len(owners) == 1, (row, owners)
        names.append(owners.pop())
    return names


def datamodule(corpus, tokenizer, cache_dir, **kwargs) -> PretrainDataModule:
    dm = PretrainDataModule(corpus, tokenizer, objective_for(tokenizer), cache_dir, **kwargs)
    dm.setup("fit")
    return dm


def test_blend_keeps_every_stretch_in_proportion():
    source, rank = blend(np.array([700, 300]))
    assert len(source) == 1000
    for s, count in ((0, 700), (1, 300)):
        assert list(rank[source == s]) == list(range(count))  # each source in its own order
    for start in range(0, 1000, 100):  # every stretch of 100 slots: 70 and 30, within 1
        assert abs(int((source[start : start + 100] == 0).sum()) - 70) <= 1


def test_weights_decide_the_share_of_sequences_rows_never_mix_sources(sources, tokenizer, tmp_path):
    corpus = MixtureCorpus(sources, weights={"alpha": 0.3, "beta": 0.7})
    dm = datamodule(corpus, tokenizer, tmp_path, val_fraction=0.1)
    batches = dm.train_set
    assert isinstance(batches, MixtureBatches)
    seen = {"alpha": 0, "beta": 0}
    for epoch in range(2):
        for index in range(len(batches)):
            for name in row_sources(batches[(epoch, index)], tokenizer):
                seen[name] += 1
    share = seen["beta"] / (seen["alpha"] + seen["beta"])
    assert abs(share - 0.7) < 0.02, seen
    # counted on from call to call, in any order, as if counted afresh
    slots = batches.batch_size * batches.world_size
    for epoch, done in [(0, 3), (0, 7), (0, 2), (1, 5), (0, 9), (0, 9), (2, 0)]:
        fresh = np.bincount(
            batches.slot_source[: min(done * slots, batches.plan.num_items)], minlength=2
        )
        assert list(batches.consumed(epoch, done)) == list(epoch * batches.per_epoch + fresh)
    # what the run logs per source counts the same sequences, and epochs of each source
    progress = batches.progress(dm.source_names, 2, 0)
    for s, name in enumerate(dm.source_names):
        assert progress[name]["sequences"] == seen[name]
        assert progress[name]["epochs"] == seen[name] / batches.source_items[s]


def test_epochs_set_each_sources_passes(sources, tokenizer, tmp_path):
    corpus = MixtureCorpus(sources, epochs={"alpha": 0.5, "beta": 3})
    dm = datamodule(corpus, tokenizer, tmp_path, val_fraction=0)
    batches = dm.train_set
    items = batches.source_items
    assert list(batches.per_epoch) == [round(0.5 * items[0]), 3 * items[1]]
    done = batches.progress(dm.source_names, 1, 0)
    assert done["alpha"]["epochs"] == pytest.approx(0.5, abs=0.01)
    assert done["beta"]["epochs"] == 3
    assert list(batches.source_epochs()) == pytest.approx([0.5, 3], abs=0.01)
    # the source's items run on across mixture epochs: alpha's second half comes in epoch 1
    first = {tuple(r) for r in batches[(0, 0)]["input_ids"].tolist()}
    assert first != {tuple(r) for r in batches[(1, 0)]["input_ids"].tolist()}


def test_validation_is_per_source_and_the_batches_are_a_function_of_the_position(
    sources, tokenizer, tmp_path
):
    corpus = MixtureCorpus(sources, weights={"alpha": 1, "beta": 1})
    dm = datamodule(corpus, tokenizer, tmp_path, val_fraction=0.2, seed=7)
    val = [b for b in dm.val_dataloader()]
    tags = [int(b[VAL_SOURCE]) for b in val]
    assert set(tags[:2]) == {0, 1}  # interleaved: the first batches already cover both
    assert [tags.count(s) for s in (0, 1)] == [len(source) for source in dm.val_set.sources]
    for batch in val:
        name = dm.source_names[int(batch[VAL_SOURCE])]
        assert set(row_sources({k: v.numpy() for k, v in batch.items()}, tokenizer)) == {name}
    # a second datamodule restored at a position hands out exactly the batches that follow
    steps = iter(dm.train_dataloader())
    for _ in range(3):
        next(steps)
    state = dm.state_dict()
    again = datamodule(corpus, tokenizer, tmp_path, val_fraction=0.2, seed=7)
    again.load_state_dict(state)
    for expected, got in zip(steps, again.train_dataloader(), strict=False):
        assert expected.keys() == got.keys()
        assert all(bool((expected[k] == got[k]).all()) for k in expected)


def test_resuming_under_other_weights_is_refused(sources, tokenizer, tmp_path):
    dm = datamodule(
        MixtureCorpus(sources, weights={"alpha": 0.8, "beta": 0.2}), tokenizer, tmp_path
    )
    state = dm.state_dict()
    other = datamodule(
        MixtureCorpus(sources, weights={"alpha": 0.5, "beta": 0.5}), tokenizer, tmp_path
    )
    with pytest.raises(
        DataSetupError, match=r"add data\.epochs=null 'data\.weights=\{alpha: 0\.8, beta: 0\.2\}'"
    ):
        other.load_state_dict(state)
    single = datamodule(sources["alpha"], tokenizer, tmp_path)
    with pytest.raises(DataSetupError, match="sampled a mixture by weights"):
        single.load_state_dict(state)


def test_each_source_has_its_own_store_shared_with_single_corpus_runs(sources, tokenizer, tmp_path):
    corpus = MixtureCorpus(sources, weights={"alpha": 0.5, "beta": 0.5})
    stats = prepare_stores(corpus, tokenizer, objective_for(tokenizer), tmp_path)
    assert [s.documents for s in stats] == [120, 40] and all(s.built for s in stats)
    [alone] = prepare_stores(sources["beta"], tokenizer, objective_for(tokenizer), tmp_path)
    assert not alone.built and alone.path == stats[1].path
    # the weights decide the sampling, not the text: a reweighted mixture keys the same caches
    assert (
        corpus.fingerprint() == MixtureCorpus(sources, epochs={"alpha": 1, "beta": 2}).fingerprint()
    )


def test_the_shipped_mixture_config_and_its_fingerprint(sources, tmp_path, monkeypatch):
    """conf/data/mixture.yaml composes as `make pretrain data=mixture` composes it; a source's
    text keys the caches, its weight does not."""
    point_shipped_corpora_at(tmp_path, monkeypatch)
    cfg = compose_pretrain("data=mixture", "data.weights.glue_texts=0.5")
    corpus = instantiate(cfg.data)
    assert corpus.names == ["wikitext2", "glue_texts"] and not corpus.by_epochs
    assert corpus.amounts == {"wikitext2": 0.8, "glue_texts": 0.5}
    assert isinstance(corpus.sources["wikitext2"], TextFilesCorpus)
    changed = dict(sources, beta=ListCorpus(documents("beta", 40, 3)))
    even = {"epochs": {"alpha": 1, "beta": 1}}
    assert (
        MixtureCorpus(sources, **even).fingerprint() != MixtureCorpus(changed, **even).fingerprint()
    )


@pytest.mark.parametrize(
    "spec",
    [
        {"sources": ["wikitext2", "glue_texts"], "by": "weights", "amounts": [0.3, 0.7]},
        {"sources": ["wikitext2", "glue_texts"], "by": "epochs", "amounts": [1.0, 3.0]},
    ],
)
@pytest.mark.parametrize("run_by", ["weights", "epochs"])
def test_the_resume_hint_gives_the_checkpoints_sampling_when_pasted(
    spec, run_by, tmp_path, monkeypatch
):
    """`resume_overrides`, added after a run's own overrides (by weights or by epochs), composes
    to the checkpoint's sampling: no dotted key into a mapping the config left null."""
    own = (
        ["data.weights=null", "data.epochs={wikitext2: 2, glue_texts: 1}"]
        if run_by == "epochs"
        else []
    )
    point_shipped_corpora_at(tmp_path, monkeypatch)
    hint = shlex.split(resume_overrides(spec))
    corpus = instantiate(compose_pretrain("data=mixture", *own, *hint).data)
    assert corpus.spec() == spec


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": {"alpha": 1}}, r"data\.weights must name every source .*missing beta"),
        ({"weights": {"alpha": 1, "beta": 1, "gamma": 1}}, "unknown gamma"),
        ({"weights": {"alpha": 1, "beta": 0}}, r"data\.weights\.beta=0 is not a positive number"),
        ({"epochs": {"alpha": 1, "beta": float("nan")}}, r"data\.epochs\.beta=nan"),
        (
            {"weights": {"alpha": 1, "beta": 1}, "epochs": {"alpha": 1, "beta": 1}},
            r"not both: to sample by epochs, add data\.weights=null",
        ),
    ],
)
def test_bad_mixture_settings_name_the_key(sources, kwargs, message):
    with pytest.raises(CorpusError, match=message):
        MixtureCorpus(sources, **kwargs)
    with pytest.raises(CorpusError, match="data.sources is empty"):
        MixtureCorpus({})


def test_a_source_with_bad_input_is_named(sources, tokenizer, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"Fine text here.\n\nThen \xff broken bytes.\n")
    even = {"epochs": {"alpha": 1, "crawl": 1}}
    crawl = TextFilesCorpus(paths=str(bad))
    corpus = MixtureCorpus({"alpha": sources["alpha"], "crawl": crawl}, **even)
    dm = PretrainDataModule(corpus, tokenizer, objective_for(tokenizer), tmp_path / "cache")
    with pytest.raises(
        CorpusError, match=r"^data\.sources\.crawl: .*bad\.txt: invalid UTF-8"
    ) as err:
        dm.check_documents()
    assert "data.sources.crawl.errors=replace" in str(err.value)
    tiny = {"alpha": sources["alpha"], "tiny": ListCorpus(["One sentence."])}
    small = MixtureCorpus(tiny, epochs={"alpha": 1, "tiny": 1})
    dm = PretrainDataModule(small, tokenizer, objective_for(tokenizer), tmp_path / "cache")
    with pytest.raises(DataSetupError, match=r"^data\.sources\.tiny: the corpus \(1 in-memory"):
        dm.check_documents()


def test_merged_bert_rows_keep_their_masked_positions():
    narrow = {
        "input_ids": np.array([[1, 5, 2, 0]]),
        "attention_mask": np.array([[1, 1, 1, 0]]),
        "masked_positions": np.array([1]),
        "mlm_labels": np.array([9]),
        "nsp_labels": np.array([0]),
    }
    wide = {
        "input_ids": np.array([[1, 6, 7, 8, 2, 0, 0, 0], [1, 6, 2, 0, 0, 0, 0, 0]]),
        "attention_mask": np.array([[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]),
        "masked_positions": np.array([3, 9]),
        "mlm_labels": np.array([4, 3]),
        "nsp_labels": np.array([1, 0]),
    }
    merged = merge_batches([narrow, wide], pad_id=0)
    assert merged["input_ids"].shape == (3, 8)
    flat = merged["input_ids"].reshape(-1)
    # each masked position still points at the token it pointed at before the merge
    assert list(merged["masked_positions"]) == [1, 8 + 3, 16 + 1]
    assert list(flat[merged["masked_positions"]]) == [5, 8, 6]
    assert list(merged["nsp_labels"]) == [0, 1, 0]


def test_a_mixture_without_weights_or_epochs_is_refused_and_either_fix_works_pasted(tmp_path):
    """Neither data.weights nor data.epochs (the docs ask for one): refused, with both ways to
    say it as shell words that compose when pasted after the same command."""
    command = ("model=gpt-tiny", *write_two_source_mixture(tmp_path), "data.weights=null")
    with pytest.raises(ConfigError, match="data.weights and data.epochs are both null") as refused:
        check_config(compose_pretrain(*command))
    fixes = re.findall(r"'data\.(?:weights|epochs)=\{[^}]*\}'", str(refused.value))
    assert fixes == ["'data.weights={alpha: 1, beta: 1}'", "'data.epochs={alpha: 1, beta: 1}'"]
    for fix in fixes:
        plan = check_config(compose_pretrain(*command, *shlex.split(fix)))
        assert plan.corpus.amounts == {"alpha": 1.0, "beta": 1.0}


def test_a_missing_source_path_names_the_sources_own_key(tmp_path):
    """A mixture source's path that matches nothing: the error's key is the source's (Hydra's
    `full_key`), and that key, set to a file, gets past it."""
    command = ("model=gpt-tiny", *write_two_source_mixture(tmp_path))
    gone = tmp_path / "gone.txt"
    with pytest.raises(
        ConfigError, match=rf"^data\.sources\.beta\.paths pattern '{gone}' matches no file"
    ):
        check_config(compose_pretrain(*command, f"data.sources.beta.paths={gone}"))
    found = f"data.sources.beta.paths={tmp_path / 'alpha.txt'}"
    assert check_config(compose_pretrain(*command, found)).corpus.sources["beta"].files


def test_weights_that_miss_or_add_a_source_hint_the_whole_mapping_which_works_after_make(
    tmp_path,
):
    """The mapping a user's own config gives, with a source missing and a stray name: the hint
    replaces it whole (Hydra refuses a key new to it, even inside a whole mapping, unless the
    mapping is nulled first), in ARGS: make keeps only the last of two assignments of one
    variable, so `data.weights=null 'data.weights={...}'` as two make variables loses the null.
    Pasted after `make`, it runs; its two words alone compose after `python -m`."""
    mixture = write_two_source_mixture(tmp_path, weights="{alpha: 0.7, gamma: 2}")
    with pytest.raises(ConfigError, match="missing beta; unknown gamma") as refused:
        check_config(compose_pretrain("model=gpt-tiny", *mixture))
    [args] = re.findall(r'ARGS="[^"]*"', str(refused.value))
    assert args == "ARGS=\"data.weights=null 'data.weights={alpha: 0.7, beta: 1}'\""
    assert "(after make; after python -m, the two words alone)" in str(refused.value)
    [assignment] = shlex.split(args)  # what the shell hands make: ARGS=<the two words>
    words = shlex.split(assignment.partition("=")[2])
    plan = check_config(compose_pretrain("model=gpt-tiny", *mixture, *words))
    assert plan.corpus.amounts == {"alpha": 0.7, "beta": 1.0}
    made = run_make("tokenizer", *cache_command(tmp_path, *mixture)[3:], *shlex.split(args))
    assert made.returncode == 0, made.stderr[-3000:]
    [corpus] = [line for line in made.stdout.splitlines() if line.startswith("corpus ")]
    assert "mixture of alpha (weight 0.7: 1 text file(s)" in corpus and "beta" in corpus


def run_make(target: str, *words: str) -> subprocess.CompletedProcess:
    """`make -s <target> <words>` as a user's shell runs it (ALLOCATOR=system: tcmalloc may be
    missing), outside any make this test runs under."""
    inherited = ("ALLOCATOR", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    return subprocess.run(
        ["make", "-s", target, "ALLOCATOR=system", *words],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def cache_command(tmp_path, *overrides: str) -> list[str]:
    """`make tokenizer`'s command line (`python -m pipeline.commands.tokenizer`), caches
    under `tmp_path`: the quickest command that reads every source."""
    return [
        sys.executable,
        "-m",
        "pipeline.commands.tokenizer",
        "model=gpt-tiny",
        "tokenizer.vocab_size=300",
        f"paths.cache_dir={tmp_path}/cache",
        f"paths.output_root={tmp_path}/out",
        *overrides,
    ]


def test_invalid_utf8_in_a_source_names_its_errors_key_which_works_pasted(tmp_path):
    """Read by the tokenizer, which trains on every source: the error names the source and
    the source's own `errors` key, with which the command runs."""
    mixture = write_two_source_mixture(tmp_path)
    bad = tmp_path / "bad.txt"
    bad.write_bytes((tmp_path / "beta.txt").read_bytes() + b"\nBroken \xff bytes.\n")
    overrides = (*mixture, f"data.sources.beta.paths={bad}")
    plan = check_config(compose_pretrain("model=gpt-tiny", *overrides))
    with pytest.raises(CorpusError, match=rf"^data\.sources\.beta: {bad}: invalid UTF-8") as err:
        list(plan.corpus.documents())
    hint = re.search(r"set (\S+) \(substitute U\+FFFD\)", str(err.value))[1]
    assert hint == "data.sources.beta.errors=replace"
    command = cache_command(tmp_path, *overrides, hint)
    pasted = run_command(command[2], *command[3:])  # `python -m ...`, in this process
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert "mixture of alpha (weight 0.7: 1 text file(s)" in pasted.stdout


def test_leaving_a_source_out_as_the_error_says_works_after_make(tmp_path):
    """A source weighted 0: the error's ARGS, pasted after `make`, drops the source and its
    weight (a `~key` cannot be a make variable)."""
    mixture = write_two_source_mixture(tmp_path)
    with pytest.raises(ConfigError, match=r"data\.weights\.beta=0 is not a positive") as refused:
        check_config(compose_pretrain("model=gpt-tiny", *mixture, "data.weights.beta=0"))
    [args] = re.findall(r'ARGS="[^"]*"', str(refused.value))
    assert args == 'ARGS="~data.sources.beta ~data.weights.beta"'
    settings = [*cache_command(tmp_path, *mixture)[3:], "data.weights.beta=0"]
    made = run_make("tokenizer", *settings, *shlex.split(args))
    assert made.returncode == 0, made.stderr[-3000:]
    [corpus] = [line for line in made.stdout.splitlines() if line.startswith("corpus ")]
    assert "mixture of alpha (weight 0.7: 1 text file(s)" in corpus and "beta" not in corpus


def test_source_keys_moves_hint_keys_and_leaves_paths_that_look_like_keys():
    message = (
        "data.errors: invalid UTF-8; set data.errors=replace, or check data.paths "
        "(not 'data.paths' or /x/data.errors) and data.text_field"
    )
    assert source_keys(message, "data.sources.web", ["errors", "paths"]) == (
        "data.sources.web: data.errors: invalid UTF-8; set data.sources.web.errors=replace, or "
        "check data.sources.web.paths (not 'data.paths' or /x/data.errors) and data.text_field"
    )
    moved = source_keys("data.paths pattern 'x' matches no file", "data.sources.web", ["paths"])
    assert moved == "data.sources.web.paths pattern 'x' matches no file"
