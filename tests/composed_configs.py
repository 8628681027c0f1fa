"""Pretraining configs composed once per session for the tests that only read them.

Hydra composes `conf/pretrain.yaml` in a few tenths of a second (seconds on a loaded machine),
and the config tests (tests/conf/test_compose.py, tests/pipeline/test_config_check.py) compose
the same presets again and again (`model=bert`, `model=gpt recipe=gpt-fast`, every experiment).
`composed_pretrain` composes each distinct list of overrides once and gives every caller a copy
of its own, so that a test may change what it gets without another test seeing it. A list that
fails to compose is not kept: it fails again, the same way, for every caller.
"""

from __future__ import annotations

import copy
import functools

from omegaconf import DictConfig

from tests.conftest import compose_pretrain


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    return compose_pretrain(*overrides)


def composed_pretrain(*overrides: str) -> DictConfig:
    """`compose_pretrain(*overrides)` (no Hydra node), composed once per session: a copy."""
    return copy.deepcopy(_composed(overrides))
