"""Sliding-window chunking, truncation baselines and per-document aggregation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from datamodules.tasks.long_text import (
    chunk_document,
    chunk_spans,
    sample_chunks,
    truncate,
)

CLS, SEP = 101, 102


@pytest.mark.parametrize("num_tokens", [1, 7, 8, 9, 10, 11, 12, 13, 50, 51, 1000])
@pytest.mark.parametrize(("window", "stride"), [(8, 8), (8, 5), (8, 1), (5, 2), (1, 1)])
def test_spans_cover_every_token_with_the_configured_overlap(
    num_tokens: int, window: int, stride: int
) -> None:
    spans = chunk_spans(num_tokens, window, stride)
    covered = np.zeros(num_tokens, dtype=bool)
    for start, end in spans:
        assert 0 <= start < end <= num_tokens
        assert end - start == min(window, num_tokens)  # every chunk is full
        covered[start:end] = True
    assert covered.all()
    assert spans[0][0] == 0
    assert spans[-1][1] == num_tokens
    # regular chunks: one every `stride` tokens, sharing window - stride tokens with the previous
    for (s0, e0), (s1, _) in itertools.pairwise(spans[:-1]):
        assert s1 - s0 == stride
        assert e0 - s1 == window - stride
    # the final chunk overlaps its predecessor by at least window - stride, at most window - 1
    if len(spans) > 1:
        overlap = spans[-2][1] - spans[-1][0]
        assert window - stride <= overlap <= window - 1
        expected_exact = (num_tokens - window) % stride == 0
        assert (overlap == window - stride) == expected_exact


def test_spans_worked_example() -> None:
    assert chunk_spans(10, 4, 2) == [(0, 4), (2, 6), (4, 8), (6, 10)]
    # one more token: the last chunk moves left to end at 11 and overlaps by 3, not 2
    assert chunk_spans(11, 4, 2) == [(0, 4), (2, 6), (4, 8), (6, 10), (7, 11)]


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 8])
def test_short_document_gives_one_chunk(num_tokens: int) -> None:
    assert chunk_spans(num_tokens, 8, 4) == [(0, num_tokens)]


def test_exact_multiple_lengths() -> None:
    # no overlap, length a multiple of the window: plain tiling, no extra chunk
    assert chunk_spans(24, 8, 8) == [(0, 8), (8, 16), (16, 24)]
    # num_tokens - window a multiple of stride: the last chunk is the regular next one
    assert chunk_spans(20, 8, 4) == [(0, 8), (4, 12), (8, 16), (12, 20)]


@pytest.mark.parametrize(
    ("num_tokens", "window", "stride", "match"),
    [
        (10, 4, 5, "stride must be in"),
        (10, 4, 0, "stride must be in"),
        (10, 4, -1, "stride must be in"),
        (10, 0, 1, "window must be"),
        (-1, 4, 2, "num_tokens"),
    ],
)
def test_bad_spans_raise(num_tokens: int, window: int, stride: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        chunk_spans(num_tokens, window, stride)


def test_chunk_document_wraps_each_chunk() -> None:
    ids = np.arange(1, 12)  # 11 content tokens, as a token store would give them
    chunks = chunk_document(ids, [CLS], [SEP], window=4, stride=2)
    assert [c[1:-1] for c in chunks] == [ids[s:e].tolist() for s, e in chunk_spans(11, 4, 2)]
    assert all(c[0] == CLS and c[-1] == SEP and len(c) == 6 for c in chunks)
    assert all(type(t) is int for c in chunks for t in c)
    assert chunk_document([5, 6], [CLS], [SEP], window=4, stride=2) == [[CLS, 5, 6, SEP]]


def test_chunk_document_rejects_special_tokens_inside() -> None:
    with pytest.raises(ValueError, match="add_special_tokens=False"):
        chunk_document([CLS, 5, 6, SEP], [CLS], [SEP], window=4, stride=2)


def test_chunk_document_gpt_style_has_only_a_suffix() -> None:
    chunks = chunk_document(list(range(10)), [], [99], window=4, stride=3)
    assert chunks == [[0, 1, 2, 3, 99], [3, 4, 5, 6, 99], [6, 7, 8, 9, 99]]


def test_truncate_head_and_head_tail() -> None:
    ids = list(range(100))
    assert truncate(ids, 10) == list(range(10))
    assert truncate(ids, 10, "head_tail", head=3) == [0, 1, 2, *range(93, 100)]
    assert truncate(ids, 10, "head_tail", head=10) == list(range(10))
    assert truncate(ids, 10, "head_tail", head=0) == list(range(90, 100))
    # the Sun et al. setting on a long document
    long_ids = np.arange(2000)
    kept = truncate(long_ids, 510, "head_tail", head=128)
    assert kept == [*range(128), *range(2000 - 382, 2000)]
    # within the budget: unchanged
    assert truncate(ids[:7], 10, "head_tail", head=3) == ids[:7]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_content": 0}, "max_content"),
        ({"max_content": 10, "mode": "tail"}, "truncation mode"),
        ({"max_content": 10, "mode": "head_tail", "head": 11}, "head must be"),
    ],
)
def test_truncate_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        truncate(list(range(20)), **kwargs)


def test_sample_chunks() -> None:
    rng = np.random.default_rng(0)
    picked = sample_chunks(10, 3, rng)
    assert len(picked) == 3 and len(set(picked)) == 3
    assert picked == sorted(picked) and all(0 <= i < 10 for i in picked)
    assert sample_chunks(2, 3, rng) == [0, 1]
    # same seed, same subset (resume); over many draws every chunk gets picked
    assert sample_chunks(10, 3, np.random.default_rng(5)) == sample_chunks(
        10, 3, np.random.default_rng(5)
    )
    seen = {i for seed in range(50) for i in sample_chunks(10, 3, np.random.default_rng(seed))}
    assert seen == set(range(10))
    with pytest.raises(ValueError, match="k"):
        sample_chunks(10, 0, rng)
