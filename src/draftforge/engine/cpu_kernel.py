"""The engine's own CPU kernels (`csrc/`, AVX2 + FMA), each built once per machine:

- `skinny_linear.cpp`: y = x·Wᵀ for few rows. MKL and oneDNN serve a product of 1–17 rows through a 576-wide weight
  at half the machine's read bandwidth or less (docs/benchmarks.md "The engine's AVX2 kernel"); this kernel streams
  each weight once per call and reaches 1.4–2× their speed there. One more route of `cpu_linear`, chosen only where
  the tuner measures it fastest.
- `decode_attention.cpp`: a decode step's attention for a few query rows over the KV cache (`blocks.attend`,
  docs/architecture.md "CPU attention").
- `layer_ops.cpp`: a decoder layer's element-wise work (RMSNorm, residual + RMSNorm, SwiGLU, q/k norms and rotary)
  in one call each (`layer_ops.py`, docs/architecture.md "CPU layer ops"); built with -ffp-contract=off.

Built with torch's C++ extension loader on first use (about 40 s each on 2 cores, then cached under
TORCH_EXTENSIONS_DIR and reused by every later process). No AVX2, no compiler or a failed build leave a kernel
unavailable: `available()` says so once in the log with the reason, and the library serves what it would have.
`DRAFTFORGE_CPU_KERNEL=0` turns them all off.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "skinny_linear.cpp"
class Kernel(NamedTuple):
    source: Path
    name: str  # the extension's name
    fallback: str  # what serves its calls when it is unavailable
    flags: tuple[str, ...] = ()  # compiler flags beside the common ones


KERNELS = {"skinny_linear": Kernel(SOURCE, "draftforge_skinny_linear", "the library routes serve every product"),
           "decode_attention": Kernel(CSRC / "decode_attention.cpp", "draftforge_decode_attention",
                                      "SDPA serves every attention"),
           "layer_ops": Kernel(CSRC / "layer_ops.cpp", "draftforge_layer_ops",
                               "torch's ops serve the layers' element-wise work", ("-ffp-contract=off",))}
_modules: dict[str, Any] = {}  # kernel → built extension, or None once unavailable
_reasons: dict[str, str] = {}


def _load(kernel: str) -> Any:
    if os.environ.get("DRAFTFORGE_CPU_KERNEL", "1") == "0":
        raise RuntimeError("DRAFTFORGE_CPU_KERNEL=0")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise RuntimeError(f"CPU capability {torch.backends.cpu.get_cpu_capability()} has no AVX2")
    if not shutil.which(os.environ.get("CXX", "c++")):
        raise RuntimeError("no C++ compiler (c++) on PATH")
    k = KERNELS[kernel]
    return build(k.source, k.name, k.flags)


def build(source: Path, name: str, flags: tuple[str, ...] = ()) -> Any:
    """The extension built from `source` under `name` with `flags` added (cached per machine, source and flags). The
    engine's are `KERNELS`; a benchmark builds a former version under another name to time both in one process."""
    from torch.utils.cpp_extension import load

    return load(name=name, sources=[str(source)], verbose=False,
                extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp", *flags], extra_ldflags=["-fopenmp"])


def available(kernel: str = "skinny_linear") -> bool:
    """Whether `kernel` is built (building it on the first call) → False, with the reason logged once, if not."""
    if kernel not in _modules:
        try:
            _modules[kernel] = _load(kernel)
        except Exception as e:  # noqa: BLE001 — any build failure leaves the library path, said once
            _modules[kernel] = None
            _reasons[kernel] = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning("engine/cpu_kernel.py: the AVX2 kernel %s is unavailable (%s); %s", kernel, _reasons[kernel],
                        KERNELS[kernel].fallback)  # fmt: skip
    return _modules[kernel] is not None


def eager_fp32(*tensors: torch.Tensor) -> bool:
    """Whether a call over `tensors` is one the engine's CPU paths (its kernels, `cpu_linear`'s routes) may serve:
    every tensor fp32 on the CPU, no autograd through any of them, not inside torch.compile."""
    grad = torch.is_grad_enabled()
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and not (grad and t.requires_grad) for t in tensors) \
        and not torch.compiler.is_compiling()


def unavailable_reason(kernel: str = "skinny_linear") -> str | None:
    return _reasons.get(kernel)


def eligible(shape: tuple[int, int]) -> bool:
    """Whether the product kernel can take products through a weight of `shape` (N, K): K a multiple of 8 (its
    vector width). Weights are contiguous (nn.Linear weights and the fused projections are)."""
    return shape[1] % 8 == 0


def skinny_linear(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 (M, K) · w (N, K)ᵀ (+ bias) → (M, N) row-major, fp32; call only where `available()` and `eligible`."""
    return _modules["skinny_linear"].skinny_linear(x2.contiguous(), w.contiguous(), None if bias is None else bias.contiguous())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, length: int,
                     scale: float) -> torch.Tensor:
    """q (G, R, D) contiguous, k, v (G, ≥ length, D) unit stride along D, mask (R, length) contiguous or None →
    (G, R, D) = softmax(q kᵀ · scale + mask) v over the first `length` rows; only where `available("decode_attention")`."""
    return _modules["decode_attention"].decode_attention(q, k, v, mask, length, scale)


def layer_ops() -> Any:
    """The built layer-ops extension (`csrc/layer_ops.cpp`); only where `available("layer_ops")`."""
    return _modules["layer_ops"]
