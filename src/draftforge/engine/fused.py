"""Compiled decoder blocks of the captured engine: fused projections and fewer, larger kernels.

A captured step (`graph.py`) removes Python and launch overhead but still replays every small kernel
the HF modules launch: per dense layer ~50 (RMSNorm in fp32 pieces, separate q/k/v and gate/up GEMVs,
q/k norms, rotary, residual adds). At one token per step each costs a few microseconds even inside a
CUDA graph, which puts an 8B AR step at ~2.8× the weight-bandwidth floor (docs/benchmarks.md). Here:

- Fused projections: q/k/v and gate/up weights are concatenated once and the HF Linear weights are
  re-pointed at views of the fused tensor (no second copy; the eager path reads the same storage).
- Three `torch.compile`d blocks with the module passed as an argument, so one compiled graph serves
  every layer of the same structure (dynamo lifts the parameters to inputs):
    qkv_block   norm → fused QKV → q/k norms → rotary            (1, n, H) → q, k, v, gate
    out_block   attention over the fixed-capacity cache → o_proj → residual → MLP block
    split_block the same after split-KV attention (split_attention.py): merge the partials → o_proj → …
    mlp_block   norm → fused gate/up → act · up → down → residual (GDN layers' MLP)
  and two for the drafter's block pass (every drafter layer has one structure):
    draft_qkv_block  norm(block) → one fused QKV GEMM over [context features; block] → q/k norms → rotary
    draft_out_block  attention over the drafter's cache → o_proj → residual → norm → fused SwiGLU → residual
  The cache writes (`index_copy_` at the span's slots) stay outside the compiled regions, so Inductor
  never functionalises a mutation of the whole cache.

Invariant: the compiled step computes the same function as the eager static step; only the rounding
of fused reductions may differ (fp32: tokens equal except at exact ties; checked by tests/gpu).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.drafter.attention import apply_rope
from draftforge.engine.split_attention import combine_splits
from draftforge.engine.target import TargetModel, attend_folded, attention_out, split_heads


@dataclass
class FusedLayer:
    wqkv: torch.Tensor | None  # (q_out + 2·kv_out, H) attention layers only
    bqkv: torch.Tensor | None  # qwen2-style q/k/v biases, fused the same way
    q_out: int  # rows of wqkv that are q (and the output gate, for gated attention)
    kv_out: int
    wgu: torch.Tensor | None  # (2·I, H) dense gate/up MLPs only (None: MoE or another MLP form)


def _fuse(linears: list[nn.Linear], bias: bool) -> torch.Tensor:
    """Concatenate Linear weights (or biases) along the output axis; re-point each at a view of the result."""
    parts = [lin.bias if bias else lin.weight for lin in linears]
    fused = torch.cat([p.detach() for p in parts], dim=0)
    start = 0
    for lin, p in zip(linears, parts):
        view = nn.Parameter(fused[start : start + p.shape[0]], requires_grad=False)
        setattr(lin, "bias" if bias else "weight", view)
        start += p.shape[0]
    return fused


def _dense_mlp(mlp: nn.Module) -> bool:
    return all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")) and not hasattr(mlp, "experts")


@torch.no_grad()
def fuse_projections(tm: TargetModel) -> list[FusedLayer]:
    """Per layer: fused q/k/v (attention layers) and gate/up (dense MLPs); idempotent."""
    out = []
    for layer, kind in zip(tm.layers, tm.kinds):
        cached = getattr(layer, "_draftforge_fused", None)
        if cached is not None:
            out.append(cached)
            continue
        wqkv = bqkv = wgu = None
        q_out = kv_out = 0
        if kind == "attention":
            a = layer.self_attn
            lins = [a.q_proj, a.k_proj, a.v_proj]
            q_out, kv_out = a.q_proj.out_features, a.k_proj.out_features
            has_bias = [lin.bias is not None for lin in lins]
            if any(has_bias) and not all(has_bias):
                raise ValueError("compiled engine: q/k/v projections with biases on some but not all of them")
            wqkv = _fuse(lins, bias=False)
            bqkv = _fuse(lins, bias=True) if all(has_bias) else None
        if _dense_mlp(layer.mlp) and layer.mlp.gate_proj.bias is None and layer.mlp.up_proj.bias is None:
            wgu = _fuse([layer.mlp.gate_proj, layer.mlp.up_proj], bias=False)
        fl = FusedLayer(wqkv=wqkv, bqkv=bqkv, q_out=q_out, kv_out=kv_out, wgu=wgu)
        layer._draftforge_fused = fl
        out.append(fl)
    return out


def qkv_block(attn: nn.Module, norm: nn.Module, wqkv: torch.Tensor, bqkv: torch.Tensor | None, h: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, q_out: int, kv_out: int, n_heads: int, n_kv: int, hd: int,
              qk_norm: bool, gated: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """h (1, n, H) → q (1, Hq, n, hd), k, v (1, Hkv, n, hd) with rotary, output gate (1, n, Hq·hd) or None."""
    qg, k, v = F.linear(norm(h), wqkv, bqkv).split([q_out, kv_out, kv_out], dim=-1)
    return split_heads(attn, qg, k, v, cos, sin, n_heads, n_kv, hd, qk_norm, gated)


def mlp_block(layer: nn.Module, wgu: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
    """h (1, n, H) → h + MLP(post-attention norm(h)); fused gate/up when the MLP is dense."""
    x = layer.post_attention_layernorm(h)
    m = layer.mlp
    if wgu is None:
        out = m(x)
        return h + (out[0] if isinstance(out, tuple) else out)
    g, u = F.linear(x, wgu).chunk(2, dim=-1)
    return h + m.down_proj(m.act_fn(g) * u)


def out_block(layer: nn.Module, wgu: torch.Tensor | None, h: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, mask: torch.Tensor, gate: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention of q (1, Hq, n, hd) over the cache (Hkv, cap, hd) under the additive folded mask
    (1, 1, g·n, cap), o_proj, residual, MLP block."""
    o = attend_folded(q, k_cache[None], v_cache[None], mask, scale)
    return mlp_block(layer, wgu, h + attention_out(layer.self_attn, o, gate))


def split_block(layer: nn.Module, wgu: torch.Tensor | None, h: torch.Tensor, acc: torch.Tensor, mx: torch.Tensor,
                sm: torch.Tensor, gate: torch.Tensor | None, n: int) -> torch.Tensor:
    """`out_block` after split-KV attention: partials (split_attention.split_partials) of n query nodes."""
    o = combine_splits(acc, mx, sm, n, h.dtype)  # (1, Hq, n, hd)
    return mlp_block(layer, wgu, h + attention_out(layer.self_attn, o, gate))


@dataclass
class FusedDraftLayer:
    wqkv: torch.Tensor  # (q_out + 2·kv_out, H)
    wgu: torch.Tensor  # (2·I, H)


@torch.no_grad()
def fuse_drafter(drafter: nn.Module) -> list[FusedDraftLayer]:
    """Per drafter layer: fused q/k/v and gate/up weights (views re-pointed as in `fuse_projections`)."""
    out = []
    for layer in drafter.layers:
        cached = getattr(layer, "_draftforge_fused", None)
        if cached is None:
            a, m = layer.self_attn, layer.mlp
            cached = FusedDraftLayer(wqkv=_fuse([a.q_proj, a.k_proj, a.v_proj], bias=False),
                                     wgu=_fuse([m.gate_proj, m.up_proj], bias=False))
            layer._draftforge_fused = cached
        out.append(cached)
    return out


def draft_qkv_block(layer: nn.Module, wqkv: torch.Tensor, h: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (1, B, H) block states, ctx (1, B, H) projected context features, cos/sin (1, 2B, hd) at [context
    slots; block slots] → q (1, Hq, B, hd) of the block, k, v (1, Hkv, 2B, hd) of [context; block]."""
    a = layer.self_attn
    B = h.shape[1]
    y = F.linear(torch.cat([ctx, layer.input_layernorm(h)], dim=1), wqkv)  # (1, 2B, q + 2·kv)
    q_out, kv_out = a.n_heads * a.head_dim, a.n_kv * a.head_dim
    q, k, v = y.split([q_out, kv_out, kv_out], dim=-1)
    q = a.q_norm(q[:, B:].view(1, B, a.n_heads, a.head_dim)).transpose(1, 2)
    k = a.k_norm(k.view(1, 2 * B, a.n_kv, a.head_dim)).transpose(1, 2)
    v = v.view(1, 2 * B, a.n_kv, a.head_dim).transpose(1, 2)
    return apply_rope(q, cos[:, None, B:], sin[:, None, B:]), apply_rope(k, cos[:, None], sin[:, None]), v


def draft_out_block(layer: nn.Module, wgu: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of the block's q over the drafter cache (Hkv, cap, hd), o_proj, residual, SwiGLU, residual."""
    a = layer.self_attn
    B = h.shape[1]
    o = attend_folded(q, k_cache[None], v_cache[None], mask, None)
    h = h + a.o_proj(o.transpose(1, 2).reshape(1, B, a.n_heads * a.head_dim))
    g, u = F.linear(layer.post_attention_layernorm(h), wgu).chunk(2, dim=-1)
    return h + layer.mlp.down_proj(F.silu(g) * u)


@dataclass
class CompiledBlocks:
    qkv: Any
    out: Any
    split: Any
    mlp: Any
    draft_qkv: Any
    draft_out: Any


def layer_blocks(compiled: bool) -> CompiledBlocks:
    """The three blocks, under torch.compile when `compiled` (static shapes: one graph per verify bucket,
    shared by every layer of one structure); as plain functions otherwise (CPU tests of the fused math)."""
    plain = dict(qkv=qkv_block, out=out_block, split=split_block, mlp=mlp_block, draft_qkv=draft_qkv_block,
                 draft_out=draft_out_block)
    if not compiled:
        return CompiledBlocks(**plain)
    import torch._dynamo
    import torch._inductor.config

    # entries per block: buckets × layer structures (attention / GDN, with or without a dense MLP)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # round to the model dtype where the eager code casts (bf16 results then differ from eager by ties only)
    torch._inductor.config.emulate_precision_casts = True
    kw: dict[str, Any] = {"dynamic": False, "fullgraph": True}
    return CompiledBlocks(**{name: torch.compile(fn, **kw) for name, fn in plain.items()})
