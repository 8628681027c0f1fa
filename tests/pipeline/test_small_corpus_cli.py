"""`make pretrain` on a corpus too small for the run: one `error:` line (no traceback, no run
folder left) that names the documents there are and the ones needed, and a fix that works when
pasted back on the command line."""

from __future__ import annotations

import pytest

from tests.conftest import run_pretrain

SENTENCES = " ".join(f"Line {i} tells of a ship that sails the sea at night." for i in range(400))

# (model, file text, what the error says): one document of one long line; two lines, which a
# blank-line corpus reads as one document; two documents.
CASES = {
    "gpt_one_line": ("gpt-tiny", SENTENCES + "\n", "has 1 document ("),
    "bert_two_lines": ("bert-tiny", f"{SENTENCES}\n{SENTENCES}\n", "has 1 document ("),
    "bert_two_documents": ("bert-tiny", f"{SENTENCES}\n\n{SENTENCES}\n", "has 2 documents ("),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tiny_corpus_fails_with_one_line_whose_fix_works_when_pasted(tmp_path, case):
    model, text, says = CASES[case]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    run = (f"model={model}", "data=text_files", f"data.paths=[{corpus}]", "debug=smoke")
    failed = run_pretrain(tmp_path, *run, "logger=csv")
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and says in errors[0], failed.stderr[-3000:]
    if model.startswith("bert"):
        assert "next-sentence prediction needs at least 2 documents" in errors[0]
    assert list((tmp_path / "out").glob("*/*")) == []  # no run folder left behind
    fix = errors[0].rsplit(": ", 1)[1].split()
    assert fix and all("=" in override for override in fix), errors[0]
    fixed = run_pretrain(tmp_path, *run, "logger=csv", *fix)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "finished 5 steps" in fixed.stdout
