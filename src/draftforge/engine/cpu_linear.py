"""CPU decoding: every Linear of a model computes through oneDNN with its weight prepacked once.

On the 2-core AVX2 machine the default world runs on, `F.linear` (MKL sgemm) is far from the memory
roofline at the row counts decoding uses: a verify of 2–17 rows costs 1.7–5× one row, and the 49K × 576
LM head over 17 rows 5× its one-row time. oneDNN's linear over a weight reordered once into its blocked
layout stays near the weight-streaming time from 1 to 17 rows (benchmarks/cpu_roofline.py,
docs/benchmarks.md "CPU roofline"); for one row through a small weight (a layer's projection in an AR
step) MKL's GEMV is quicker than oneDNN's call, so that case keeps F.linear. Through a small weight, MKL's GEMM
with the weight as the left operand, W·xᵀ, beats both at 2–5 rows (a verify of a small tree: about one row's
time, where oneDNN costs 1.2–1.5×) and at multiples of 8 from 16 to 128 rows (the drafter's 16-slot block, a
chain verify: 1.2–1.4×); at 6–15 and other row counts oneDNN is as fast or faster (docs/benchmarks.md "Skinny
products on the CPU"). Same function, other rounding: every engine mode calls the same patched modules, so
eager and static decoding stay equal to each other.

Invariants: the packed copy is used only without autograd (inference); a weight changed in place after
packing (an optimizer step, load_state_dict) bumps its version and is repacked on the next call, so a
stale copy is never read; CUDA or non-fp32 weights are left alone.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

SMALL_WEIGHT = 1 << 22  # below this many values a one-row product stays on F.linear (oneDNN's call costs more)
# Below this many values a weight is not packed at all: oneDNN's fixed cost per call exceeds the whole product
# (a 64 × 64 weight: ~3-10× F.linear's time at 1-17 rows), so only tiny models (the tests' random ones) are left
# on F.linear; every projection of a real target (SmolLM2-135M's smallest, k/v, is 576 × 192) is packed.
PACK_MIN = 1 << 16
# Row counts that compute as W·xᵀ through a small weight: 2..SKINNY_ROWS, and multiples of 8 in
# [16, WIDE_ROWS]. SKINNY_ROWS = 0 turns the path off (benchmarks compare the two).
SKINNY_ROWS = 5
WIDE_ROWS = 128


def weight_left(rows: int) -> bool:
    """Whether `rows` rows through a small weight compute as W·xᵀ (see the module docstring)."""
    return SKINNY_ROWS > 0 and (2 <= rows <= SKINNY_ROWS or (rows % 8 == 0 and 16 <= rows <= WIDE_ROWS))


def _weight_left(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, bias) as W·xᵀ: x (..., K), w (N, K) → (..., N), contiguous."""
    rows = x.numel() // x.shape[-1]
    y = torch.mm(w, x.reshape(rows, x.shape[-1]).t()).t()  # (M, N) from (N, K)·(K, M)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's function for a weight that is not an nn.Linear (a drafter's draft-vocabulary head): W·xᵀ at
    the row counts where MKL runs it faster on the CPU, F.linear otherwise (and under autograd, off the CPU)."""
    if (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)) or x.dtype != torch.float32 \
            or x.device.type != "cpu" or not weight_left(x.numel() // x.shape[-1]):
        return F.linear(x, w, bias)
    return _weight_left(x, w, bias)


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (torch.is_grad_enabled() and w.requires_grad) or x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, w, self.bias)
    rows = x.numel() // x.shape[-1]
    if w.numel() < SMALL_WEIGHT and rows == 1:  # one row, a small weight: MKL's GEMV is quicker
        return F.linear(x, w, self.bias)
    if w.numel() < SMALL_WEIGHT and weight_left(rows):
        return _weight_left(x, w, self.bias)
    if self._draftforge_packed_version != (w.data_ptr(), w._version):  # changed since packing: repack
        _pack(self)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    y = torch.ops.mkldnn._linear_pointwise(x2, self._draftforge_packed, self.bias, "none", [], "")  # (M, N)
    return y.reshape(*x.shape[:-1], y.shape[-1])


@torch.no_grad()
def _pack(lin: nn.Linear) -> None:
    w = lin.weight
    lin._draftforge_packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 1)
    lin._draftforge_packed_version = (w.data_ptr(), w._version)


def pack_linears(module: nn.Module) -> int:
    """Route every fp32 CPU nn.Linear of `module` with at least PACK_MIN weights through a prepacked oneDNN
    weight (idempotent) → how many."""
    if not torch.backends.mkldnn.is_available():
        return 0
    n = 0
    for lin in module.modules():
        if not isinstance(lin, nn.Linear) or hasattr(lin, "_draftforge_packed"):
            continue
        if lin.weight.device.type != "cpu" or lin.weight.dtype != torch.float32 or lin.weight.numel() < PACK_MIN:
            continue
        _pack(lin)
        lin.forward = types.MethodType(_packed_forward, lin)
        n += 1
    return n
