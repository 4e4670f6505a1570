"""The target decoder layer's math, written once as three blocks that every engine mode calls.

    qkv_block        input norm → q/k/v projections (fused or not) → q/k norms → rotary
    post_attention   output gate → o_proj → mlp_block (residual added there)
    mlp_block        residual → post-attention norm → gate/up (fused or not) → act · up → down → residual
    split_block      post_attention after split-KV attention (split_attention.py): merge the partials first

The eager engine calls them as plain functions; the captured engine calls the same functions, or
`torch.compile`d versions of them (`fused.layer_blocks`), with the module passed as an argument so one
compiled graph serves every layer of one structure. Attention itself and the cache writes stay between
the blocks (`target.run_layers`), so a compiled region never functionalises a write to the whole cache.
A layer's fused weights (`FusedLayer.wqkv` / `wgu`) are views the HF Linear weights also point at
(`fused.fuse_projections`); None means the HF projections run one by one — the same function either way.
Fused products go through `cpu_linear.linear` (F.linear itself off the CPU and under torch.compile); norms, SwiGLU and
the fused path's q/k norms and rotary through `layer_ops` (the modules' own ops there too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.engine import cpu_kernel, cpu_linear, layer_ops
from draftforge.engine.split_attention import combine_splits


@dataclass
class FusedLayer:
    """Per target layer: the fused projection weights, or None where the HF projections run one by one."""

    wqkv: torch.Tensor | None = None  # (q_out + 2·kv_out, H) attention layers only
    bqkv: torch.Tensor | None = None  # qwen2-style q/k/v biases, fused the same way
    q_out: int = 0  # rows of wqkv that are q (and the output gate, for gated attention)
    kv_out: int = 0
    wgu: torch.Tensor | None = None  # (2·I, H) dense gate/up MLPs only (None: MoE or unfused)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (1, heads, n, hd); rotary on the first `rot` dims (rot = hd unless partial), the rest passes."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat([xr * cos + _rotate_half(xr) * sin, xp], dim=-1)


def split_heads(attn: nn.Module, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, n_heads: int, n_kv: int, hd: int, qk_norm: bool, gated: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Projections (1, n, ·) → q (1, heads, n, hd), k, v (1, kv_heads, n, hd) with rotary, output gate or None."""
    n = qg.shape[1]
    gate = None
    if gated:
        qg = qg.reshape(1, n, n_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(1, n, n_heads * hd)
    else:
        q = qg.reshape(1, n, n_heads, hd)
    k, v = k.reshape(1, n, n_kv, hd), v.reshape(1, n, n_kv, hd)
    if qk_norm:  # per-head RMSNorm before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (1, heads, n, hd)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate


def qkv_block(attn: nn.Module, norm: nn.Module, wqkv: torch.Tensor | None, bqkv: torch.Tensor | None,
              h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: int, kv_out: int, n_heads: int,
              n_kv: int, hd: int, qk_norm: bool, gated: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """h (1, n, H) → q (1, Hq, n, hd), k, v (1, Hkv, n, hd) with rotary, output gate (1, n, Hq·hd) or None."""
    x = layer_ops.rms_norm(norm, h)
    if wqkv is None:
        qg, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        qkv = cpu_linear.linear(x, wqkv, bqkv)  # (1, n, q_out + 2·kv_out)
        heads = None if gated else layer_ops.rope_heads(attn, qkv, cos, sin, n_heads, n_kv, hd, qk_norm)
        if heads is not None:
            return (*heads, None)
        qg, k, v = qkv.split([q_out, kv_out, kv_out], dim=-1)
    return split_heads(attn, qg, k, v, cos, sin, n_heads, n_kv, hd, qk_norm, gated)


def mlp_block(layer: nn.Module, wgu: torch.Tensor | None, h: torch.Tensor, r: torch.Tensor | None = None
              ) -> torch.Tensor:
    """h (1, n, H), plus the residual r (1, n, H) when given: s = h + r → s + MLP(post-attention norm(s)); fused
    gate/up when the MLP is dense and fused."""
    norm = layer.post_attention_layernorm
    s, x = layer_ops.add_rms_norm(norm, h, r) if r is not None else (h, layer_ops.rms_norm(norm, h))
    m = layer.mlp
    if wgu is None:
        out = m(x)
        return s + (out[0] if isinstance(out, tuple) else out)  # some MoE blocks also return router logits
    return s + m.down_proj(layer_ops.act_mul(m.act_fn, cpu_linear.linear(x, wgu)))


def attention_out(attn: nn.Module, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """o (1, heads, n, hd) → (1, n, H): output gate (gated attention) and o_proj."""
    _, hq, n, hd = o.shape
    o = o.transpose(1, 2).reshape(1, n, hq * hd)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return attn.o_proj(o)


def post_attention(layer: nn.Module, wgu: torch.Tensor | None, h: torch.Tensor, o: torch.Tensor,
                   gate: torch.Tensor | None) -> torch.Tensor:
    """Attention output o (1, Hq, n, hd) → o_proj, residual, MLP block."""
    return mlp_block(layer, wgu, h, attention_out(layer.self_attn, o, gate))


def split_block(layer: nn.Module, wgu: torch.Tensor | None, h: torch.Tensor, acc: torch.Tensor, mx: torch.Tensor,
                sm: torch.Tensor, gate: torch.Tensor | None, n: int) -> torch.Tensor:
    """`post_attention` after split-KV attention: partials (split_attention.split_partials) of n query nodes."""
    return post_attention(layer, wgu, h, combine_splits(acc, mx, sm, n, h.dtype), gate)


# Folded query rows (a KV group's query heads × the span's nodes) up to which the CPU attention kernel serves an
# fp32 attention: 1.5–2.2× faster than SDPA through 6 rows, about equal from 12 on the 2-core AVX2 machine
# (docs/benchmarks.md "A decode-attention kernel"); SDPA serves more.
KERNEL_ATTENTION_ROWS = 8


def _kernel_attention(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `attend_folded` takes the CPU kernel: fp32 on the CPU without autograd or compile, one sequence, few
    rows, vector-wide heads with unit stride, an additive fp32 mask or none, and the kernel built."""
    return (cpu_kernel.eager_fp32(qf, k, v) and qf.shape[0] == 1 and qf.shape[2] <= KERNEL_ATTENTION_ROWS
            and qf.shape[3] % 8 == 0 and k.stride(3) == 1 and v.stride(3) == 1
            and (mask is None or (mask.dtype == torch.float32 and mask.shape[:2] == (1, 1)))
            and cpu_kernel.available("decode_attention"))  # fmt: skip


def attend_folded(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float | None) -> torch.Tensor:
    """Folded query rows qf (1, Hkv, R, hd) over k, v (1, Hkv, L, hd) → (1, Hkv, R, hd); mask additive (1, 1, R, L)
    or None (every key visible); scale None: hd^−½. The engine's CPU kernel where `_kernel_attention`, else SDPA:
    the same function, rounded differently (docs/architecture.md "CPU attention")."""
    if _kernel_attention(qf, k, v, mask):
        m = None if mask is None else mask[0, 0].contiguous()
        s = qf.shape[3] ** -0.5 if scale is None else scale
        return cpu_kernel.decode_attention(qf[0].contiguous(), k[0], v[0], m, k.shape[2], s)[None]
    return F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
           scale: float | None) -> torch.Tensor:
    """Attention of q (1, Hq, n, hd) over k, v (1, Hkv, L, hd) → (1, Hq, n, hd), GQA without expanding K/V.

    mask: additive over the folded query rows (1, 1, g·n, L) (row = query head in group × node), or None
    (every key visible; with `causal`, SDPA's causal rule over a span that starts at row 0)."""
    _, hq, n, hd = q.shape
    hkv = k.shape[1]
    if mask is None and causal and n > 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=hq != hkv)
    return attend_folded(q.reshape(1, hkv, (hq // hkv) * n, hd), k, v, mask, scale).reshape(1, hq, n, hd)


def fold_mask(mask: torch.Tensor | None, group: int) -> torch.Tensor | None:
    """(1, 1, n, L) → (1, 1, group·n, L): the same rows for every query head of a KV group."""
    if mask is None or group == 1:
        return mask
    return mask.repeat(1, 1, group, 1)
