"""`make generate`: continue a prompt with a trained GPT (pipeline/infer/generation.py).

python -m pipeline.commands.generate ckpt=outputs/gpt/<stamp> prompt="The meaning of life"
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT for the registry)
from pipeline.checkpoint.load import expect_inference, load_pretrained, require_keys, resolve_device
from pipeline.infer.generation import Sampling, generate, print_samples
from pipeline.run.cli import entry_point, user_errors


@hydra.main(config_path="../../conf", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        require_keys(cfg, 'make generate ckpt=outputs/gpt/<stamp> prompt="..."', "ckpt")
        sampling = Sampling.from_config(cfg)
        device = resolve_device(cfg.device)
        pretrained = load_pretrained(cfg.ckpt)
        expect_inference(pretrained, "generate")
        pretrained.model.to(device)
        print(f"{pretrained.family} model from {pretrained.source} on {device}", file=sys.stderr)
        prompt = "" if cfg.prompt is None else str(cfg.prompt)
        print_samples(generate(pretrained, prompt, sampling, device))


if __name__ == "__main__":
    entry_point(main, literal_keys=("prompt",))
