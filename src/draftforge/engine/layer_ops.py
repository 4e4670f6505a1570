"""A decoder layer's element-wise work — RMSNorm, residual add + RMSNorm, SwiGLU's silu(g)·u, q/k per-head norms and
rotary — as one function each, for the target's layers (`blocks.py`) and the drafter's block pass.

Each function computes what the module or torch expression beside it computes. On the CPU in fp32 without autograd
or torch.compile, where the layer-ops kernel is built (`cpu_kernel`, `csrc/layer_ops.cpp`), one kernel call does it:
torch spends 3–9 µs of dispatch on each of the 5–20 small ops these take, more than their arithmetic at a decode
step's few rows (docs/architecture.md "CPU layer ops"). Everywhere else — the GPU, bf16, training, compiled blocks —
the module or torch expression runs, so those paths are as before.

A norm module takes the kernel only after a probe showed it computes weight · x / rms(x) (HF's Llama/Qwen RMSNorm and
the drafter's; not the (1 + weight) form some models use), and an activation only after a probe showed it is SiLU;
the verdict is kept on the module. The rotary is bitwise torch's; the norms and silu agree within a few ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.engine import cpu_kernel

ENABLED = True  # benchmarks set False to time torch's ops on the same build
# Rows (positions) up to which the kernel serves a call: a decode step's verify or block pass. Beyond, torch's
# multi-threaded ops are the faster (a prefill; measured in docs/benchmarks.md "CPU layer ops").
KERNEL_ROWS = 64
_PROBE_TOL = 1e-5  # relative: a kernel within this of the module computes the module's function


def usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether a layer op over `x` (with `weights`) takes the kernel: fp32 CPU, at most KERNEL_ROWS rows, no
    autograd, not compiling, built."""
    return (ENABLED and x.numel() <= KERNEL_ROWS * x.shape[-1] and cpu_kernel.eager_fp32(x, *weights)
            and cpu_kernel.available("layer_ops"))


def _eps(norm: nn.Module) -> float | None:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a - b).abs().max() <= _PROBE_TOL * b.abs().max().clamp_min(1.0)).item())


def _plain_norm(norm: nn.Module) -> float | None:
    """The eps of `norm` when it computes weight · x / sqrt(mean(x²) + eps) over the last dim (probed once; kept on
    the module as `_draftforge_rms`), else None."""
    verdict = norm.__dict__.get("_draftforge_rms", False)
    if verdict is not False:
        return verdict
    eps, w = _eps(norm), getattr(norm, "weight", None)
    verdict = None
    if eps is not None and isinstance(w, torch.Tensor) and w.dim() == 1 and w.dtype == torch.float32 \
            and w.is_contiguous():
        x = torch.randn(3, w.shape[0], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            verdict = eps if _close(cpu_kernel.layer_ops().rms_norm(x, w.detach(), eps), norm(x)) else None
    norm.__dict__["_draftforge_rms"] = verdict
    return verdict


def _is_silu(act: nn.Module) -> bool:
    """Whether `act` is SiLU (probed once; kept on the module as `_draftforge_silu`)."""
    verdict = act.__dict__.get("_draftforge_silu")
    if verdict is None:
        gu = 4 * torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            verdict = _close(cpu_kernel.layer_ops().silu_mul(gu), act(gu[:, :32]) * gu[:, 32:])
        act.__dict__["_draftforge_silu"] = verdict
    return verdict


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x) for x (..., n)."""
    if usable(x, norm.weight) and x.is_contiguous():
        eps = _plain_norm(norm)
        if eps is not None:
            return cpu_kernel.layer_ops().rms_norm(x, norm.weight, eps)
    return norm(x)


def add_rms_norm(norm: nn.Module, h: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + r, norm(h + r)) for h, r (..., n): a residual add and the norm after it."""
    if usable(h, r, norm.weight) and h.is_contiguous() and r.is_contiguous() and h.shape == r.shape:
        eps = _plain_norm(norm)
        if eps is not None:
            return cpu_kernel.layer_ops().add_rms_norm(h, r, norm.weight, eps)
    s = h + r
    return s, norm(s)


def act_mul(act: nn.Module | None, gu: torch.Tensor) -> torch.Tensor:
    """act(g) · u for the fused gate/up rows gu (..., 2I) = [g | u] → (..., I); act None: SiLU."""
    if usable(gu) and gu.is_contiguous() and (act is None or _is_silu(act)):
        return cpu_kernel.layer_ops().silu_mul(gu)
    g, u = gu.chunk(2, dim=-1)
    return (F.silu(g) if act is None else act(g)) * u


def rope_heads(attn: nn.Module, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int,
               hd: int, qk_norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The fused q/k/v rows qkv (1, n, (n_heads + 2·n_kv)·hd) → q (1, n_heads, n, hd), k, v (1, n_kv, n, hd), with
    per-head q/k norms (`qk_norm`) and full rotary (cos/sin (1, 1, n, hd)), contiguous; None where the kernel does not
    serve this call (the caller runs torch's ops: `blocks.split_heads`)."""
    weights = (attn.q_norm.weight, attn.k_norm.weight) if qk_norm else ()
    if not (usable(qkv, cos, sin, *weights) and qkv.is_contiguous() and cos.shape[-1] == hd and cos.is_contiguous()
            and sin.is_contiguous()):
        return None
    eps = _plain_norm(attn.q_norm) if qk_norm else 0.0
    if qk_norm and (eps is None or _plain_norm(attn.k_norm) != eps):
        return None
    return cpu_kernel.layer_ops().rope_heads(qkv, cos, sin, n_heads, n_kv, hd, *(weights or (None, None)), eps)
