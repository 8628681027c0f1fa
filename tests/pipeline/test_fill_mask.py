"""`make fill-mask`: a loaded BERT's guesses for [MASK], checked against the logits by hand."""

from __future__ import annotations

import pytest
import torch

from pipeline.checkpoint.load import load_pretrained
from pipeline.infer.mask_filling import best_filling, fill_mask, format_guesses, mask_probabilities
from pipeline.run.errors import CheckpointLoadError, ConfigError
from tests.pipeline.test_generate import run_cli
from tests.pipeline.tiny_models import write_run

CPU = torch.device("cpu")
TEXT = "The [MASK] module is imported, and it's [MASK] once."


@pytest.fixture
def bert(tmp_path):
    _, _, ckpt = write_run(tmp_path / "bert", "bert")
    return load_pretrained(ckpt)


def logits_by_hand(bert, text: str) -> tuple[list[int], torch.Tensor]:
    """MLM logits of every token (no gathering), and the [MASK] positions."""
    encoding = bert.tokenizer.encode(text)
    with torch.no_grad():
        out = bert.model(torch.tensor([encoding.ids]))  # all-zero token types, no padding
    mask_id = bert.tokenizer.token_to_id("[MASK]")
    positions = [i for i, t in enumerate(encoding.ids) if t == mask_id]
    return positions, out.mlm_logits[0]


def test_guesses_are_the_softmax_of_the_logits(bert):
    positions, logits_TV = logits_by_hand(bert, TEXT)
    assert len(positions) == 2
    ids, found, probs_NV = mask_probabilities(bert, TEXT, CPU)
    assert found == positions and ids[0] == bert.tokenizer.token_to_id("[CLS]")
    assert torch.allclose(probs_NV.sum(dim=-1), torch.ones(2), atol=1e-5)
    assert torch.allclose(probs_NV, logits_TV[positions].softmax(dim=-1), atol=1e-6)

    guesses = fill_mask(bert, TEXT, top_k=5, device=CPU)
    assert [g.position for g in guesses] == positions
    for guess, position in zip(guesses, positions, strict=True):
        assert len(guess.tokens) == 5
        assert guess.probs == sorted(guess.probs, reverse=True)
        assert guess.token_ids[0] == int(logits_TV[position].argmax())
        assert guess.tokens == [bert.tokenizer.id_to_token(i) for i in guess.token_ids]
        assert 0 < sum(guess.probs) <= 1


def test_table_and_best_filling(bert):
    guesses = fill_mask(bert, TEXT, top_k=3, device=CPU)
    table = format_guesses(guesses).splitlines()
    assert table[0] == f"[MASK] 1 of 2 (token {guesses[0].position})"
    assert table[1].split() == ["rank", "token", "probability"]
    assert table[2].split() == ["1", guesses[0].tokens[0], f"{guesses[0].probs[0]:.4f}"]
    assert table[5] == f"[MASK] 2 of 2 (token {guesses[1].position})"
    assert len(table) == 10
    filled = best_filling(bert, TEXT, guesses)
    assert "[MASK]" not in filled and "module is imported" in filled
    for guess in guesses:
        assert guess.tokens[0].removeprefix("##") in filled


def test_text_without_mask_and_too_long_text(bert):
    with pytest.raises(ConfigError, match=r"has no \[MASK\]"):
        fill_mask(bert, "No blanks here.", top_k=5, device=CPU)
    with pytest.raises(ConfigError, match="at most 128"):
        fill_mask(bert, "word " * 200 + "[MASK]", top_k=5, device=CPU)


def test_fill_mask_needs_the_mlm_head(bert):
    bert.model = bert.model.bert
    with pytest.raises(CheckpointLoadError, match="not a BERT with its MLM head"):
        fill_mask(bert, TEXT, top_k=5, device=CPU)


def make_flags(*words: str) -> str:
    """MAKEFLAGS as make writes it for `make target word...` (newest first, escaped)."""
    escaped = (w.replace("\\", "\\\\").replace(" ", "\\ ").replace("$", "$$") for w in words)
    return " -- " + " ".join(reversed(list(escaped)))


def test_fill_mask_command_from_make(tmp_path, bert):
    """As `make fill-mask ckpt=... text="..."`: the text reaches the model verbatim."""
    words = [f"ckpt={tmp_path / 'bert'}", f"text={TEXT}", "top_k=3", "device=cpu"]
    env = {"LMPIPE_FROM_MAKE": "1", "MAKEFLAGS": make_flags(*words)}
    result = run_cli("pipeline.commands.fill_mask", tmp_path=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    guesses = fill_mask(bert, TEXT, top_k=3, device=CPU)
    expected = f"{format_guesses(guesses)}\nbest: {best_filling(bert, TEXT, guesses)}\n"
    assert result.stdout == expected
    assert list((tmp_path / "lmpipe-fill-mask").rglob("*")) == []
