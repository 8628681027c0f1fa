"""Bounded memory: preparing a corpus of a few hundred MB keeps peak RSS far under 2 GB and
about the same as for a corpus ten times smaller (slow: it tokenizes ~250 MB)."""

import json
import subprocess
import sys

import pytest

from tests.datamodules.helpers import WIKITEXT_TRAIN

# Run in a fresh process so that its peak RSS is the store build's alone.
CHILD = """
import hashlib, json, resource, sys, tempfile
from datamodules.corpora.corpus import TextFilesCorpus
from datamodules.stores.store import StoreSettings
from datamodules.stores.build import open_or_build_store
from tokenizer import batched, train_tokenizer

class Repeated:
    '''WikiText-2 train, repeated: a large real-text corpus generated on the fly.'''
    def __init__(self, path, times):
        self.base, self.times = TextFilesCorpus(path, doc_split="wikitext"), times
    def documents(self):
        for copy in range(self.times):
            for doc in self.base.documents():
                yield doc
    def fingerprint(self):
        return hashlib.sha256(f"{self.base.fingerprint()}x{self.times}".encode()).hexdigest()[:16]
    def describe(self):
        return f"WikiText-2 train x{self.times}"

path, times = sys.argv[1], int(sys.argv[2])
corpus = Repeated(path, times)
tokenizer = train_tokenizer("wordpiece", batched(corpus.base.documents()), 8000)
with tempfile.TemporaryDirectory() as cache:
    _, stats = open_or_build_store(corpus, tokenizer, StoreSettings(sentences=True), cache)
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"peak_mb": peak_mb, "text_mb": stats.text_bytes / 1e6, "tokens": stats.tokens}))
"""


def prepare_in_child(times: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(WIKITEXT_TRAIN), str(times)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_is_bounded_while_preparing_a_large_corpus():
    if not WIKITEXT_TRAIN.is_file():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT_TRAIN} (set LMPIPE_SHARED_DATA)")
    small, large = prepare_in_child(2), prepare_in_child(24)
    assert large["text_mb"] > 250
    assert large["peak_mb"] < 2048
    # Ten times the text, about the same memory: nothing grows with the corpus.
    assert large["peak_mb"] - small["peak_mb"] < 150, (small, large)
