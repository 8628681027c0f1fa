"""trainer.precision=null on a CPU: bf16 only with native bf16 instructions that measure faster."""

from __future__ import annotations

import pytest
import torch

from pipeline.training import precision


@pytest.mark.parametrize(
    ("flags", "speedup", "expected"),
    [
        ({"avx2", "fma"}, None, "32-true"),  # emulated bf16: not even measured
        ({"avx512f", "avx512_bf16"}, 1.9, "bf16-mixed"),
        ({"amx_bf16", "amx_tile"}, 2.5, "bf16-mixed"),
        ({"avx512_bf16"}, 0.8, "32-true"),  # native, but measured slower here
    ],
)
def test_a_cpu_gets_bf16_only_where_it_is_native_and_faster(monkeypatch, flags, speedup, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)

    def measured() -> float:
        assert speedup is not None, "measured on a CPU without native bf16"
        return speedup

    monkeypatch.setattr(precision, "cpu_bf16_matmul_speedup", measured)
    assert precision.best_precision() == expected


def test_this_cpus_flags_are_read():
    flags = precision.cpu_flags()
    assert (
        not flags
        or "fpu" in flags
        or any(f.startswith(("sse", "avx", "neon", "asimd")) for f in flags)
    )
    assert precision.cpu_bf16_matmul_speedup(n=64, reps=1) > 0
