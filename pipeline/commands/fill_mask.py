"""`make fill-mask`: a trained BERT's most likely tokens for each [MASK] in a text
(pipeline/infer/mask_filling.py).

    python -m pipeline.commands.fill_mask ckpt=outputs/bert/<stamp> text="Paris is [MASK]."
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT for the registry)
from pipeline.checkpoint.load import expect_inference, load_pretrained, require_keys, resolve_device
from pipeline.infer.mask_filling import best_filling, fill_mask, format_guesses
from pipeline.run.cli import entry_point, user_errors


@hydra.main(config_path="../../conf", config_name="fill_mask", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        usage = 'make fill-mask ckpt=outputs/bert/<stamp> text="The capital of France is [MASK]."'
        require_keys(cfg, usage, "ckpt", "text")
        device = resolve_device(cfg.device)
        pretrained = load_pretrained(cfg.ckpt)
        expect_inference(pretrained, "fill-mask")
        pretrained.model.to(device)
        print(f"{pretrained.family} model from {pretrained.source} on {device}", file=sys.stderr)
        text = str(cfg.text)
        guesses = fill_mask(pretrained, text, cfg.top_k, device)
        print(format_guesses(guesses))
        print(f"best: {best_filling(pretrained, text, guesses)}")


if __name__ == "__main__":
    entry_point(main, literal_keys=("text",))
