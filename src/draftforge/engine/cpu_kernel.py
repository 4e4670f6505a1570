"""The engine's own CPU product kernel: `csrc/skinny_linear.cpp` (AVX2 + FMA), built once per machine.

MKL and oneDNN serve a product of 1–17 rows through a 576-wide weight at half the machine's read bandwidth or
less (docs/benchmarks.md "The engine's AVX2 kernel"); this kernel streams each weight once per call and reaches
1.4–2× their speed there. It is one more route of `cpu_linear`, chosen only where the tuner measures it fastest.

Built with torch's C++ extension loader on first use (about 40 s on 2 cores, then cached under
TORCH_EXTENSIONS_DIR and reused by every later process). No AVX2, no compiler or a failed build leave the route
unavailable: `available()` says so once in the log with the reason, and the other routes serve every product.
`DRAFTFORGE_CPU_KERNEL=0` turns the route off.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "skinny_linear.cpp"
_module: list[Any] = []  # [built extension] or [None] once unavailable
_reason: list[str] = []


def _load() -> Any:
    if os.environ.get("DRAFTFORGE_CPU_KERNEL", "1") == "0":
        raise RuntimeError("DRAFTFORGE_CPU_KERNEL=0")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise RuntimeError(f"CPU capability {torch.backends.cpu.get_cpu_capability()} has no AVX2")
    if not shutil.which(os.environ.get("CXX", "c++")):
        raise RuntimeError("no C++ compiler (c++) on PATH")
    return build(SOURCE, "draftforge_skinny_linear")


def build(source: Path, name: str) -> Any:
    """The extension built from `source` under `name` (cached per machine and source). The engine's is `SOURCE`; a
    benchmark builds a former version under another name to time both in one process."""
    from torch.utils.cpp_extension import load

    return load(name=name, sources=[str(source)], verbose=False, extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                extra_ldflags=["-fopenmp"])  # fmt: skip


def available() -> bool:
    """Whether the kernel is built (building it on the first call) → False, with the reason logged once, if not."""
    if not _module:
        try:
            _module.append(_load())
        except Exception as e:  # noqa: BLE001 — any build failure leaves the other routes, said once
            _module.append(None)
            _reason.append(f"{type(e).__name__}: {e}".splitlines()[0])
            log.warning("engine/cpu_kernel.py: the AVX2 product kernel is unavailable (%s); the library routes serve "
                        "every product", _reason[0])  # fmt: skip
    return _module[0] is not None


def unavailable_reason() -> str | None:
    return _reason[0] if _reason else None


def eligible(shape: tuple[int, int]) -> bool:
    """Whether the kernel can take products through a weight of `shape` (N, K): K a multiple of 8 (its vector
    width). Weights are contiguous (nn.Linear weights and the fused projections are)."""
    return shape[1] % 8 == 0


def skinny_linear(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 (M, K) · w (N, K)ᵀ (+ bias) → (M, N) row-major, fp32; call only where `available()` and `eligible`."""
    return _module[0].skinny_linear(x2.contiguous(), w.contiguous(), None if bias is None else bias.contiguous())
