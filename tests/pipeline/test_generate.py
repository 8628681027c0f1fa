"""`make generate`: sampling from a loaded GPT, its settings, and the command line."""

from __future__ import annotations

import logging

import pytest
import torch
from hydra import compose, initialize_config_dir

from pipeline.checkpoint.load import load_pretrained, require_keys
from pipeline.infer.generation import Sampling, continue_ids, generate, prompt_ids
from pipeline.run.cli import literal_text_overrides
from pipeline.run.errors import ConfigError
from tests.conftest import CONF, REPO, run_command
from tests.pipeline.tiny_models import write_run
from tokenizer.special import EOT

CPU = torch.device("cpu")
PROMPT = "The module, it's [here]: "


@pytest.fixture
def gpt(tmp_path):
    _, _, ckpt = write_run(tmp_path / "gpt", "gpt")
    return load_pretrained(ckpt)


def greedy_by_hand(model, ids: list[int], steps: int, eos: int) -> list[int]:
    """Argmax decoding by re-running the whole sequence each step (no cache, no sampling)."""
    ids, new = list(ids), []
    for _ in range(steps):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if token == eos:
            break
        new.append(token)
        ids.append(token)
    return new


def test_greedy_equals_argmax_decoding_by_hand(gpt):
    ids = prompt_ids(gpt, PROMPT)
    eos = gpt.tokenizer.token_to_id(EOT)
    expected = greedy_by_hand(gpt.model, ids, 15, eos)
    assert len(expected) > 0
    greedy = Sampling(max_new_tokens=15, temperature=0.0)
    assert continue_ids(gpt, ids, greedy, CPU) == [expected]
    top_1 = Sampling(max_new_tokens=15, temperature=0.8, top_k=1, seed=99)
    assert continue_ids(gpt, ids, top_1, CPU) == [expected]


def test_sampling_is_repeatable_for_a_seed(gpt):
    settings = dict(max_new_tokens=20, temperature=1.0, top_k=None, num_samples=2)
    first = generate(gpt, PROMPT, Sampling(**settings, seed=7), CPU)
    assert first == generate(gpt, PROMPT, Sampling(**settings, seed=7), CPU)
    assert first != generate(gpt, PROMPT, Sampling(**settings, seed=8), CPU)
    assert len(first) == 2 and first[0] != first[1]
    assert all(text.startswith(PROMPT) and len(text) > len(PROMPT) for text in first)


def test_empty_prompt_starts_from_end_of_text(gpt):
    eot = gpt.tokenizer.token_to_id(EOT)
    assert prompt_ids(gpt, "") == [eot]
    sampling = Sampling(max_new_tokens=10, temperature=1.0, seed=3)
    (new,) = continue_ids(gpt, [eot], sampling, CPU)
    assert 0 < len(new) <= 10 and eot not in new
    assert generate(gpt, "", sampling, CPU) == [gpt.tokenizer.decode(new)]


def test_continuations_stop_before_end_of_text(gpt):
    eot = gpt.tokenizer.token_to_id(EOT)
    with torch.no_grad():
        gpt.model.output_weight[eot] = 0.0  # an end-of-text logit of 0 ...
        gpt.model.output_weight[eot, 0] = 1e4  # ... then one that always wins
    assert continue_ids(gpt, [5, 6], Sampling(temperature=0.0), CPU) == [[]]


def test_prompt_longer_than_the_context_warns(gpt, caplog):
    ids = prompt_ids(gpt, "word " * 100)
    with caplog.at_level(logging.WARNING):
        continue_ids(gpt, ids, Sampling(max_new_tokens=40), CPU)
    assert "exceed the 128 tokens the model was trained on" in caplog.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("num_samples", 0),
        ("temperature", -1.0),
        ("top_k", 0),
        ("top_p", 0.0),
    ],
)
def test_invalid_sampling_settings_name_the_key(field, value):
    with pytest.raises(ConfigError, match=f"{field}={value}"):
        Sampling(**{field: value})


def test_config_defaults_match_sampling_defaults():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("generate", overrides=["ckpt=x"])
        missing = compose("generate")
    assert Sampling.from_config(cfg) == Sampling()
    assert (cfg.prompt, cfg.device) == ("", "auto")
    require_keys(cfg, "usage", "ckpt")
    with pytest.raises(ConfigError, match="ckpt is required: make generate ckpt="):
        require_keys(missing, "make generate ckpt=PATH", "ckpt")


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is [MASK].",
        "Hello, world",
        "it's ${HOME} and \\${x} \\",
        "a\\'b",
        "42",
        "null",
        "  spaced  ",
        "",
    ],
)
def test_free_text_reaches_the_config_verbatim(text):
    overrides = literal_text_overrides(["ckpt=x", f"prompt={text}", "top_k=3"], ("prompt",))
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("generate", overrides=overrides)
    assert cfg.prompt == text
    assert cfg.top_k == 3


def test_already_quoted_text_is_left_to_hydra():
    assert literal_text_overrides(["prompt='a, b'"], ("prompt",)) == ["prompt='a, b'"]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("generate", overrides=["ckpt=x", "prompt='a, b'"])
    assert cfg.prompt == "a, b"


# ----------------------------------------------------------------------------------------------
# The command line


def run_cli(module: str, *args: str, tmp_path, env: dict | None = None, cwd=REPO):
    environment = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    return run_command(module, *args, cwd=cwd, timeout=300, env={**environment, **(env or {})})


def test_generate_command_prints_the_samples_and_leaves_nothing(tmp_path, gpt):
    run_dir = tmp_path / "gpt"
    settings = dict(max_new_tokens=12, temperature=0.9, top_k=20, num_samples=2, seed=5)
    result = run_cli(
        "pipeline.commands.generate",
        f"ckpt={run_dir}",
        f"prompt={PROMPT}",
        *(f"{k}={v}" for k, v in settings.items()),
        "device=cpu",
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = generate(gpt, PROMPT, Sampling(**settings), CPU)
    assert result.stdout == (
        f"--- sample 1 of 2 ---\n{expected[0]}\n--- sample 2 of 2 ---\n{expected[1]}\n"
    )
    assert "gpt model from" in result.stderr
    assert list((tmp_path / "lmpipe-generate").rglob("*")) == []  # no log, no .hydra


def test_generate_and_fill_mask_refuse_the_other_family(tmp_path):
    _, _, bert = write_run(tmp_path / "bert", "bert")
    _, _, gpt = write_run(tmp_path / "gpt", "gpt")
    for module, args, hint in [
        ("pipeline.commands.generate", [f"ckpt={bert}", "prompt=Once"], "make fill-mask"),
        ("pipeline.commands.fill_mask", [f"ckpt={gpt}", "text=Paris is [MASK]."], "make generate"),
    ]:
        result = run_cli(module, *args, tmp_path=tmp_path)
        assert result.returncode == 2, (module, result.stderr[-3000:])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and hint in errors[0], result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_on_gpu_under_bf16_autocast(gpt):
    ids = prompt_ids(gpt, PROMPT)
    with torch.no_grad():
        top2 = gpt.model(torch.tensor([ids])).logits[0, -1].topk(2).values
    on_cpu = continue_ids(gpt, ids, Sampling(max_new_tokens=8, temperature=0.0), CPU)
    gpt.model.to("cuda")
    cuda = torch.device("cuda")
    on_gpu = continue_ids(gpt, ids, Sampling(max_new_tokens=8, temperature=0.0), cuda)
    if top2[0] - top2[1] > 0.05:  # bf16 cannot flip a clear winner
        assert on_gpu[0][:1] == on_cpu[0][:1]
    sampled = Sampling(max_new_tokens=8, temperature=1.0, top_k=None, num_samples=2, seed=1)
    assert continue_ids(gpt, ids, sampled, cuda) == continue_ids(gpt, ids, sampled, cuda)
