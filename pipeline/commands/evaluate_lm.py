"""`make evaluate-lm`: score a text file with a causal model, in bits per byte
(pipeline/infer/lm_scoring.py).

python -m pipeline.commands.evaluate_lm ckpt=outputs/gpt/<stamp> file=wiki.test.raw
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from pipeline.checkpoint.load import expect_inference, load_pretrained, require_keys, resolve_device
from pipeline.infer.lm_scoring import read_text, score_text
from pipeline.run.cli import entry_point, user_errors
from tokenizer.cache import write_text_atomic


@hydra.main(config_path="../../conf", config_name="evaluate_lm", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        require_keys(cfg, "make evaluate-lm ckpt=outputs/gpt/<stamp> file=test.txt", "ckpt", "file")
        text = read_text(Path(str(cfg.file)))
        device = resolve_device(cfg.device)
        pretrained = load_pretrained(cfg.ckpt)
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


if __name__ == "__main__":
    entry_point(main)
