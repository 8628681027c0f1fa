"""`make lm-eval`'s check, run before lm-evaluation-harness is installed or started: the folder
it is given must be a Hugging Face export of a model that continues text, which lm-eval's `hf`
model loads with `AutoModelForCausalLM`. A BERT export (a masked model: our runs write
`BertForPreTraining`, or `BertModel` without heads) would fail deep inside lm-eval with a
TypeError; here it is refused in a line that names the command scoring it on BLiMP. Reads only
`config.json` (no torch, no lm-eval), so the check costs nothing.

    python -m pipeline.commands.lm_eval_check FOLDER CKPT   # FOLDER: what lm-eval would load
                                                            # CKPT: the ckpt= the user gave
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

# How an HF config's `architectures` name a model trained to fill in masked words.
MASKED_ARCHITECTURES = ("ForMaskedLM", "ForPreTraining")
GPT_RUN = "a GPT run folder (outputs/gpt/<run>) or its hf/ export"


def refusal(folder: Path, ckpt: str) -> str | None:
    """Why lm-eval cannot score the export in `folder` (from `ckpt=`), with what to run
    instead; None when it is the export of a causal model (or of a kind not known here, which
    lm-eval judges itself)."""
    blimp = f"make evaluate-lm {shlex.quote(f'ckpt={ckpt}')} suite=blimp"
    if not Path(ckpt).exists():
        return f"ckpt={ckpt} does not exist; give {GPT_RUN}"
    config_file = folder / "config.json"
    if not config_file.is_file():
        return (
            f"ckpt={ckpt} holds no Hugging Face export (no config.json in it or in its hf/ "
            f"folder, which a run writes when it ends); give {GPT_RUN}, or score the run's "
            f"checkpoint on BLiMP without lm-eval: {blimp}"
        )
    try:
        config = json.loads(config_file.read_text())
        kind, architectures = config.get("model_type"), list(config.get("architectures") or [])
    except (OSError, ValueError, AttributeError, TypeError) as err:
        return f"{config_file} is not an HF config ({type(err).__name__}: {err}); give {GPT_RUN}"
    if kind == "bert" or any(str(a).endswith(MASKED_ARCHITECTURES) for a in architectures):
        named = ", ".join(map(str, architectures)) or kind
        return (
            f"ckpt={ckpt} is a masked language model ({named}), which lm-eval's hf model "
            f"cannot score: it reads models that continue text (a GPT); score this one on "
            f"BLiMP with: {blimp}"
        )
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m pipeline.commands.lm_eval_check FOLDER CKPT", file=sys.stderr)
        return 2
    error = refusal(Path(argv[0]), argv[1])
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
