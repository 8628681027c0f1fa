"""The precision a Trainer gets when `trainer.precision` is null, chosen by what the hardware
does rather than assumed.

- A GPU with bf16: bf16 mixed precision.
- A CPU: bf16 mixed precision only where the CPU computes bf16 natively (the `avx512_bf16` or
  `amx_bf16` instructions) and a bf16 matrix product measures faster than an fp32 one here;
  elsewhere fp32. Without those instructions, bf16 autocast is emulated and is several times
  slower than fp32 (a 2-core AVX2 machine took longer than 20 minutes on a benchmark that fp32
  finishes in a few).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux `/proc/cpuinfo`; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def native_bf16_flags() -> list[str]:
    """The native-bf16 instructions this CPU has (none: bf16 is emulated)."""
    flags = cpu_flags()
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


@functools.cache
def cpu_bf16_matmul_speedup(n: int = 1024, reps: int = 3) -> float:
    """fp32 time / bf16 time of an `n x n` matrix product on this CPU (best of `reps`)."""

    def best_time(dtype: torch.dtype) -> float:
        # its own generator: measuring must not move the global one, which seeds the run
        generator = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, dtype=dtype, generator=generator) for _ in range(2))
        a @ b  # warm-up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    return best_time(torch.float32) / best_time(torch.bfloat16)


def best_precision() -> str:
    """bf16 mixed precision where the hardware runs it fast (see the module doc), else fp32."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    if not native_bf16_flags():
        return "32-true"
    speedup = cpu_bf16_matmul_speedup()
    choice = "bf16-mixed" if speedup > 1.1 else "32-true"
    log.info("precision %s: bf16 matmuls run %.2fx the fp32 speed on this CPU", choice, speedup)
    return choice
