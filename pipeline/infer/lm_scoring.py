"""Scoring text with a causal language model (the library behind `make evaluate-lm`,
pipeline/commands/evaluate_lm.py): total negative log-likelihood, loss per token, perplexity and
bits per byte.

Bits per byte (nats of the whole text / its UTF-8 bytes / ln 2) compares models whatever their
tokenizer: a vocabulary with longer tokens has a higher loss per token but fewer tokens. The
text is one stream that starts after an end-of-text token, as a new document does in training,
so every one of its tokens is predicted and its bytes are exactly the file's. The stream is cut
into windows of `seq_len` predictions (each window's first token has only the context of its
window: no overlap, as in training).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.checkpoint.load import Pretrained, inference_autocast
from pipeline.run.errors import ConfigError
from tokenizer.special import EOT

IGNORE = -100


@dataclass(frozen=True)
class TextScore:
    """A causal model's score on one text.

    Attributes:
        tokens: tokens predicted (all of the text's).
        bytes: UTF-8 bytes of the text.
        nats: the negative log-likelihood of the whole text, in nats.
    """

    tokens: int
    bytes: int
    nats: float

    @property
    def loss(self) -> float:
        """Mean nats per token."""
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))

    @property
    def bits_per_byte(self) -> float:
        return self.nats / self.bytes / math.log(2)

    def record(self) -> dict[str, float]:
        """The figures, for JSON."""
        return asdict(self) | {
            "loss": self.loss,
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
        }


def read_text(path: Path) -> str:
    """The file's text (UTF-8, strictly: a byte count of replaced characters would be wrong)."""
    if not path.is_file():
        raise ConfigError(f"file={path} does not exist; give a UTF-8 text file, e.g. file=test.txt")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"file={path} is not UTF-8 text (byte {err.start}: {err.reason}); convert it, e.g. "
            f"iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8.txt"
        ) from err


def score_text(
    pretrained: Pretrained,
    text: str,
    device: torch.device,
    *,
    seq_len: int | None = None,
    batch_size: int = 8,
    progress: bool = True,
) -> TextScore:
    """Score `text` with `pretrained` (a GPT) in windows of `seq_len` predictions (default: the
    length it was trained on, else its position table).

    Raises:
        ConfigError: an empty text, a window longer than the model's positions, or a tokenizer
            with no end-of-text token to start the text from.
    """
    if not text:
        raise ConfigError("the text is empty: nothing to score")
    tokenizer, model = pretrained.tokenizer, pretrained.model
    limit = model.config.max_seq_len
    seq_len = seq_len or pretrained.trained_seq_len or limit
    if not 1 <= seq_len <= limit:
        raise ConfigError(f"seq_len={seq_len} must be in [1, {limit}] (the model's positions)")
    start = tokenizer.token_to_id(EOT)
    if start is None:
        raise ConfigError(f"the tokenizer has no {EOT} token to start the text from")
    stream = torch.tensor([start, *tokenizer.encode(text, add_special_tokens=False).ids])
    windows = [stream[i : i + seq_len + 1] for i in range(0, len(stream) - 1, seq_len)]
    nats = torch.zeros((), dtype=torch.float64)
    batches = range(0, len(windows), batch_size)
    with torch.no_grad(), inference_autocast(device):
        for first in tqdm(batches, desc="scoring", unit="batch", disable=not progress):
            inputs, targets = _padded(windows[first : first + batch_size], start)
            out = model(inputs.to(device), targets=targets.to(device), reduction="sum")
            nats += out.loss.double().cpu()
    return TextScore(tokens=len(stream) - 1, bytes=len(text.encode("utf-8")), nats=float(nats))


def _padded(windows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, T): every window's tokens but the last, and but the first;
    a shorter window padded (its padding predicts nothing)."""
    width = max(len(w) for w in windows) - 1
    inputs = torch.full((len(windows), width), pad, dtype=torch.long)
    targets = torch.full((len(windows), width), IGNORE, dtype=torch.long)
    for row, window in enumerate(windows):
        inputs[row, : len(window) - 1] = window[:-1]
        targets[row, : len(window) - 1] = window[1:]
    return inputs, targets
