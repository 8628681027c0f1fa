"""Sentence splitting for BERT's next-sentence pairs: a document becomes a list of sentences.

A rule-based splitter with no NLP dependency: good enough for building NSP pairs (the original
BERT used one sentence per line of its input files) and robust to any text, since it only ever
*adds* boundaries inside a paragraph and never drops text.

Rules:
- Paragraphs ("\\n"-separated lines of a document) never share a sentence.
- Inside a paragraph, a sentence ends after `.`, `!` or `?` (and any closing quotes or
  brackets) followed by whitespace and something that can start a sentence: an upper-case
  letter, a digit, or an opening quote or bracket.
- No boundary after a common abbreviation (`Mr.`, `etc.`, `Fig.`, ...) or a single letter
  (the initial in `J. Smith`, the last letter of `e.g.` or `U.S.`).

It works on raw text and on WikiText's spaced punctuation (`the end . The next`), where the
decimal point of ` 3 @.@ 5 ` is never followed by whitespace and so never splits.
"""

from __future__ import annotations

import re

# Sentence-final punctuation with closing quotes/brackets, the whitespace, and a lookahead for a
# sentence start. (Matching the word before it in the same pattern would make the engine retry
# at every letter of the text: several times slower.)
_BOUNDARY = re.compile(r"""([.!?]+["'”’)\]]*)\s+(?=["'“‘(\[]?[A-Z0-9])""")
_WORD_BEFORE = re.compile(r"\w*$")

_ABBREVIATION_WORDS = (
    "mr mrs ms dr prof sr jr st mt vs etc cf al fig figs no nos vol vols pp ed eds jan feb mar "
    "apr jun jul aug sep sept oct nov dec inc ltd co corp gen col lt sgt capt rev gov sen rep "
    "approx dept est"
)
_ABBREVIATIONS = frozenset(_ABBREVIATION_WORDS.split())


def split_sentences(document: str) -> list[str]:
    """Split a document into sentences.

    Args:
        document: text whose paragraphs are separated by "\\n".

    Returns:
        The non-blank sentences in order, stripped. Empty for a blank document.
    """
    sentences: list[str] = []
    for paragraph in document.split("\n"):
        start = 0
        for match in _BOUNDARY.finditer(paragraph):
            end = match.start()
            if _is_abbreviation(paragraph, end, match.group(1)):
                continue
            if sentence := paragraph[start : match.end(1)].strip():
                sentences.append(sentence)
            start = match.end()
        if sentence := paragraph[start:].strip():
            sentences.append(sentence)
    return sentences


def _is_abbreviation(paragraph: str, end: int, punctuation: str) -> bool:
    """Whether the word ending at `end`, followed by `punctuation`, is an abbreviation."""
    if not punctuation.startswith("."):
        return False
    word = _WORD_BEFORE.search(paragraph, max(0, end - 16), end).group()
    if not word:
        return False
    return (len(word) == 1 and word.isalpha()) or word.lower() in _ABBREVIATIONS
