"""`make evaluate-lm`: score a text file with a causal model, in bits per byte
(pipeline/infer/lm_scoring.py), or any pretrained model on BLiMP with `suite=blimp`
(pipeline/suites/blimp.py).

python -m pipeline.commands.evaluate_lm ckpt=outputs/gpt/<stamp> file=wiki.test.raw
python -m pipeline.commands.evaluate_lm ckpt=outputs/bert/<stamp> suite=blimp
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from pipeline.checkpoint.load import expect_inference, load_pretrained, require_keys, resolve_device
from pipeline.checkpoint.source import resolve_checkpoint
from pipeline.infer.lm_scoring import read_text, score_text
from pipeline.run.cli import entry_point, user_errors
from pipeline.run.errors import ConfigError
from pipeline.suites.blimp import evaluate_blimp, report_path, write_report
from tokenizer.cache import write_text_atomic


@hydra.main(config_path="../../conf", config_name="evaluate_lm", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        suite = cfg.get("suite")
        if suite is None:
            score_file(cfg)
        elif suite.get("name") == "blimp":
            score_blimp(cfg)
        else:
            raise ConfigError(
                f"suite={suite.get('name')} is a suite of make glue; make evaluate-lm runs "
                "suite=blimp, or scores a text file with file=PATH"
            )


def score_file(cfg: DictConfig) -> None:
    require_keys(cfg, "make evaluate-lm ckpt=outputs/gpt/<stamp> file=test.txt", "ckpt", "file")
    if cfg.file is None:
        raise ConfigError(
            "give the text to score, file=PATH (e.g. file=test.txt), or suite=blimp for "
            "BLiMP's minimal pairs"
        )
    text = read_text(Path(str(cfg.file)))
    device = resolve_device(cfg.device)
    instead = (
        f"score that instead: make evaluate-lm ckpt={{ckpt}} {shlex.quote(f'file={cfg.file}')}"
    )
    pretrained = load_pretrained(cfg.ckpt, instead=instead)
    expect_inference(pretrained, "score")
    pretrained.model.to(device)
    print(f"{pretrained.family} model from {pretrained.source} on {device}", file=sys.stderr)
    score = score_text(pretrained, text, device, seq_len=cfg.seq_len, batch_size=cfg.batch_size)
    print(
        f"{cfg.file}: {score.tokens:,} tokens, {score.bytes:,} bytes; "
        f"{score.loss:.4f} nats per token (perplexity {score.perplexity:.2f}), "
        f"{score.bits_per_byte:.4f} bits per byte"
    )
    if cfg.out:
        write_text_atomic(cfg.out, json.dumps(score.record(), indent=2) + "\n")


def score_blimp(cfg: DictConfig) -> None:
    require_keys(cfg, "make evaluate-lm ckpt=outputs/<model>/<stamp> suite=blimp", "ckpt")
    if cfg.file is not None:
        raise ConfigError(
            f"file={cfg.file} and suite=blimp: a command scores either a text file or BLiMP's "
            "pairs; drop one of them"
        )
    source = resolve_checkpoint(cfg.ckpt)
    path = report_path(source, cfg.suite, cfg.out)  # a wrong out= fails before the scoring
    report = evaluate_blimp(source, cfg.suite, resolve_device(cfg.device))
    print(report.table())
    markdown = write_report(report, path)
    print(f"written: {path} and {markdown}", file=sys.stderr)


if __name__ == "__main__":
    entry_point(main)
