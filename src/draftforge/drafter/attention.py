"""Attention helpers of the drafter: RoPE, the training block mask (dense and FlexAttention), GQA attention.

Training layout for one sequence (padded to S sequences in a batch):
  keys   = [context 0..T-1 | block 0 slots 0..B-1 | block 1 ... | block N-1]     (T + N*B)
  queries=                  [block 0 slots 0..B-1 | ...                       ]     (N*B)
Invariant (the DFlash mask): a query of block n sees context positions j < anchor[n] and every slot of
block n; it never sees another block or context at/after its own anchor.
Sliding-window layers (the convention vLLM applies when it serves such a drafter): the query at slot k
(position p = anchor + k) sees only keys at positions > p − window, and inside its block only slots ≤ k
(causal); full-attention layers stay bidirectional inside the block.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

try:  # FlexAttention (torch >= 2.5); the dense SDPA mask is the fallback.
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    HAS_FLEX = True
except ImportError:  # pragma: no cover - depends on the torch build
    HAS_FLEX = False
    BlockMask = Any  # type: ignore[misc,assignment]


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE tables for absolute positions.

    positions (..., T) int64 → cos, sin (..., 1, T, head_dim), broadcastable over heads.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (..., T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., T, hd)
    return emb.cos().to(dtype).unsqueeze(-3), emb.sin().to(dtype).unsqueeze(-3)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (S, heads, T, hd); cos/sin (S or 1, 1, T, hd)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def resolve_impl(impl: str, device: torch.device) -> str:
    """'auto' → FlexAttention on CUDA (compiled kernels), dense SDPA mask elsewhere."""
    if impl == "auto":
        return "flex" if (HAS_FLEX and device.type == "cuda") else "sdpa"
    if impl not in ("flex", "sdpa"):
        raise ValueError(f"attention impl {impl!r}: use auto, flex or sdpa")
    if impl == "flex" and not HAS_FLEX:
        raise ValueError("attention impl 'flex': torch.nn.attention.flex_attention is not available in this torch")
    return impl


def dense_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int = 0) -> torch.Tensor:
    """Boolean mask, True = may attend.  anchors (S, N) int64 → (S, 1, N*B, T + N*B).

    window > 0: a sliding-window layer (windowed, causal inside the block)."""
    S, N = anchors.shape
    B = block_size
    q = torch.arange(N * B, device=anchors.device)
    q_block, q_slot = q // B, q % B  # (Q,)
    q_anchor = anchors[:, q_block]  # (S, Q)
    kv_ctx = torch.arange(ctx_len, device=anchors.device)  # (T,)
    ctx_ok = kv_ctx[None, None, :] < q_anchor[:, :, None]  # (S, Q, T)
    blk_ok = q_block[:, None] == q_block[None, :]  # (Q, Q)
    if window > 0:
        ctx_ok = ctx_ok & ((q_anchor + q_slot)[:, :, None] - kv_ctx[None, None, :] < window)
        blk_ok = blk_ok & (q_slot[None, :] <= q_slot[:, None]) & (q_slot[:, None] - q_slot[None, :] < window)
    blk_ok = blk_ok[None].expand(S, -1, -1)
    return torch.cat([ctx_ok, blk_ok], dim=-1).unsqueeze(1)


def flex_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, window: int = 0) -> "BlockMask":
    """The same mask as dense_block_mask, as a FlexAttention BlockMask (sparse tiles are skipped)."""
    S, N = anchors.shape
    B, T = block_size, ctx_len

    def mask_mod(b, h, q_idx, kv_idx):
        n, k = q_idx // B, q_idx % B
        anchor = anchors[b, n]
        is_ctx = kv_idx < T
        ctx_ok = is_ctx & (kv_idx < anchor)
        blk_ok = (~is_ctx) & ((kv_idx - T) // B == n)
        if window > 0:
            kslot = (kv_idx - T) % B
            ctx_ok = ctx_ok & (anchor + k - kv_idx < window)
            blk_ok = blk_ok & (kslot <= k) & (k - kslot < window)
        return ctx_ok | blk_ok

    return create_block_mask(mask_mod, S, None, N * B, T + N * B, device=anchors.device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    return torch.compile(flex_attention)  # dynamic after the first new shape (variable T, N)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, impl: str) -> torch.Tensor:
    """GQA attention. q (S, Hq, Q, hd); k, v (S, Hkv, K, hd); mask: bool (S,1,Q,K) | BlockMask | None.

    Returns (S, Hq, Q, hd). Every query sees at least its own block, so no row is fully masked.
    """
    dev = q.device.type
    if torch.is_autocast_enabled(dev):  # flex is not an autocast op: give it one dtype
        dt = torch.get_autocast_dtype(dev)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    elif not (q.dtype == k.dtype == v.dtype):
        k, v = k.to(q.dtype), v.to(q.dtype)
    if impl == "flex":
        fn = _compiled_flex() if q.is_cuda else flex_attention
        return fn(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def build_mask(anchors: torch.Tensor, ctx_len: int, block_size: int, impl: str, window: int = 0) -> Any:
    if impl == "flex":
        return flex_block_mask(anchors, ctx_len, block_size, window)
    return dense_block_mask(anchors, ctx_len, block_size, window)
