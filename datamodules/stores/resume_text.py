"""The text a data position was read from, saved with it, and the refusal to resume it on other
text.

A position (epoch, step, a stream's readers) means something only in the text it counted: a
source edited in place (two paragraphs swapped: the same size, the same number of batches) would
resume "exactly" into other sentences. So every data position saves the corpus fingerprint of
what it read (`datamodules.corpora.fingerprint`: the files' content, or their size and time with
`change_detection=stat`, and every setting that changes what is read), and a resume compares it
before anything else, whether the text came from a token store (one corpus or a mixture's
sources) or from a stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from datamodules.corpora.mixture import MixtureCorpus, mixture_changed

# What a position saves: one corpus's fingerprint, or a mixture's, by source name.
ReadText = str | dict[str, str]


def store_fingerprints(
    source_splits: Sequence[tuple[Any, Any]], names: list[str]
) -> ReadText | None:
    """The fingerprint of the text each store of a run was built from (its manifest's), the
    one store's alone, or by source name (`names`, a mixture's); None before any is open."""
    found = [store.manifest.get("corpus_fingerprint") for store, _ in source_splits]
    if not found:
        return None
    return dict(zip(names, found, strict=True)) if names else found[0]


def text_changed(saved: ReadText | None, now: ReadText | None, corpus) -> str | None:
    """Why a run cannot resume a position saved over `saved` (the checkpoint's fingerprints)
    when it reads `now` (this run's corpus, `corpus`); None when the text is the same, or when
    the checkpoint saved none (written before positions saved their text: not refused)."""
    if saved is None or now is None or isinstance(saved, str) != isinstance(now, str):
        return None  # a mixture against one corpus: `mixture_changed` names that
    if isinstance(saved, str):
        saved, now = {"": saved}, {"": now}
    changed = [name for name in now if name in saved and saved[name] != now[name]]
    if not changed:
        return None
    mixture = corpus if isinstance(corpus, MixtureCorpus) else None
    named = []
    for name in changed:
        where = f"data.sources.{name}" if mixture else "the corpus"
        source = mixture.sources[name] if mixture else corpus
        files = getattr(source, "files", None) or []  # local files: which ones (a few)
        what = ", ".join(files) if 0 < len(files) <= 3 else source.describe()
        named.append(f"{where} ({what}; fingerprint {saved[name]}, now {now[name]})")
    keys = f"data.sources.{changed[0]}.*" if mixture else "data.*"
    return (
        f"cannot resume the data position: {' and '.join(named)} "
        f"{'is' if len(named) == 1 else 'are'} not the text the checkpoint was trained on: a "
        "file was edited, added, removed or moved since, or a setting that changes what is "
        f"read ({keys}), so the saved position would go on in other text. Put the files "
        "and settings back as they were and resume again, or train on the new text in a new "
        "run (another run_name)"
    )


def sources_changed(state: dict[str, Any], corpus, now: ReadText | None) -> str | None:
    """Why a run over `corpus`, reading `now` (`store_fingerprints`), cannot resume the data
    position `state` of a token-store run: other sampling of a mixture (`mixture_changed`), or
    other text (`text_changed`); None when it can."""
    mine = corpus.spec() if isinstance(corpus, MixtureCorpus) else None
    if state.get("mixture") != mine:
        return mixture_changed(state.get("mixture"), mine)
    return text_changed(state.get("corpus"), now, corpus)
