"""The drafter's block pass at inference: one function for the eager, static and captured engines.

One pass drafts a block [bonus, mask × (B−1)] at positions block_pos = start..start+B−1 after appending
the projected features of newly committed context positions (`ctx_pos`) to the drafter's context KV
cache. Per layer (the training forward's math, drafter/model.py): one q/k/v projection over
[context; normed block] (q from the block rows only), per-head norms and rotary, the context and block
K/V written at their cache rows — context first, then the block, so a padded context row that shares a
block row is overwritten — then attention of the block over rows < kv_len under the layer's rule:
  full_attention     every committed context row and every block slot (bidirectional inside the block);
  sliding_attention  the query at position p sees rows p − window < row ≤ p (causal inside the block).
Cache rows are positions, so both rules are functions of block_pos alone; a static caller passes its
whole fixed capacity as kv_len and stale rows past the block are masked by the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.drafter.attention import apply_rope
from draftforge.drafter.config import SLIDING


class DraftKV:
    """The drafter's context K/V: (layers, 2, Hkv, capacity, hd), row = position. Grows by doubling unless
    fixed (a static engine's buffers never move)."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity: int, device: torch.device,
                 dtype: torch.dtype, fixed: bool = False) -> None:
        self.kv = torch.zeros(n_layers, 2, n_kv, capacity, head_dim, device=device, dtype=dtype)
        self.fixed = fixed

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def ensure(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        if self.fixed:
            from draftforge.engine.state import CapacityError

            raise CapacityError(f"drafter context: {rows} rows exceed its fixed capacity {self.capacity}")
        grown = self.kv.new_zeros(*self.kv.shape[:3], max(rows, 2 * self.capacity), self.kv.shape[4])
        grown[:, :, :, : self.capacity] = self.kv
        self.kv = grown


def draft_qkv_block(layer: nn.Module, wqkv: torch.Tensor | None, h: torch.Tensor, ctx: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (1, B, H) block states, ctx (1, c, H) projected context features, cos/sin (1, c + B, hd) at
    [context positions; block positions] → q (1, Hq, B, hd) of the block, k, v (1, Hkv, c + B, hd)."""
    a = layer.self_attn
    B, c = h.shape[1], ctx.shape[1]
    x = layer_ops.rms_norm(layer.input_layernorm, h)
    rows = torch.cat([ctx, x], dim=1)  # (1, c + B, H): same k/v weights for context and block
    if wqkv is None:
        q, k, v = a.q_proj(x), a.k_proj(rows), a.v_proj(rows)
    else:
        q, k, v = F.linear(rows, wqkv).split([a.n_heads * a.head_dim, a.n_kv * a.head_dim, a.n_kv * a.head_dim], -1)
        q = q[:, c:]
    q = a.q_norm(q.reshape(1, B, a.n_heads, a.head_dim)).transpose(1, 2)
    k = a.k_norm(k.reshape(1, c + B, a.n_kv, a.head_dim)).transpose(1, 2)
    v = v.reshape(1, c + B, a.n_kv, a.head_dim).transpose(1, 2)
    return apply_rope(q, cos[:, c:], sin[:, c:]), apply_rope(k, cos, sin), v


def draft_out_block(layer: nn.Module, wgu: torch.Tensor | None, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Attention output o (1, Hq, B, hd) → o_proj, residual, SwiGLU (fused gate/up or not), residual."""
    a, m = layer.self_attn, layer.mlp
    B = h.shape[1]
    h, x = layer_ops.add_rms_norm(layer.post_attention_layernorm, h,
                                  a.o_proj(o.transpose(1, 2).reshape(1, B, a.n_heads * a.head_dim)))
    if wgu is None:
        return h + m(x)
    return h + m.down_proj(layer_ops.act_mul(None, F.linear(x, wgu)))


@dataclass(frozen=True)
class DraftBlocks:
    draft_qkv: Any
    draft_out: Any


def _masks(layer_types: Sequence[str], window: int, block_pos: torch.Tensor, kv_len: int, group: int,
           dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Additive masks over folded query rows (1, 1, group·B, kv_len), one per layer type present."""
    cols = torch.arange(kv_len, device=block_pos.device)[None]  # (1, L)
    p = block_pos[:, None]  # (B, 1)
    out = {}
    for kind in set(layer_types):
        vis = (cols <= p) & (cols > p - window) if kind == SLIDING else (cols <= block_pos[-1:, None]).expand(p.shape[0], -1)
        mask = torch.zeros((), device=cols.device, dtype=dtype).masked_fill(~vis, float("-inf"))
        out[kind] = mask.repeat(group, 1)[None, None]
    return out


def block_pass(d: nn.Module, blocks: Any, fused: Sequence[Any] | None, block_embeds: torch.Tensor,
               block_pos: torch.Tensor, ctx_feats: torch.Tensor, ctx_pos: torch.Tensor, kv: torch.Tensor,
               kv_len: int) -> torch.Tensor:
    """One block pass (see the module docstring) → block states after the final norm (1, B, H).

    d: the drafter (DFlashDrafter or a subclass); blocks: draft_qkv / draft_out (plain or compiled);
    fused: per layer fused weights (`engine.fused.fuse_drafter`) or None; block_embeds (1, B, H) in the
    drafter's dtype; ctx_feats (1, c, n_taps·H) raw tapped features of positions ctx_pos (c,); kv the
    context cache tensor (layers, 2, Hkv, cap, hd)."""
    cfg = d.cfg
    dt = block_embeds.dtype
    a0 = d.layers[0].self_attn
    ctx = d.project_context(ctx_feats).to(dt)  # (1, c, H)
    c = ctx.shape[1]
    cos, sin = d._rope(torch.cat([ctx_pos, block_pos]), dt)  # (1, c + B, hd)
    masks = _masks(cfg.layer_types, cfg.sliding_window, block_pos, kv_len, a0.n_heads // a0.n_kv, dt)
    h = block_embeds
    for i, layer in enumerate(d.layers):
        fl = fused[i] if fused is not None else None
        q, k, v = blocks.draft_qkv(layer, fl.wqkv if fl else None, h, ctx, cos, sin)
        kv[i, 0].index_copy_(1, ctx_pos, k[0, :, :c])  # context first: the block overwrites padded rows
        kv[i, 1].index_copy_(1, ctx_pos, v[0, :, :c])
        kv[i, 0].index_copy_(1, block_pos, k[0, :, c:])
        kv[i, 1].index_copy_(1, block_pos, v[0, :, c:])
        hq, hkv = q.shape[1], kv.shape[2]
        qf = q.reshape(1, hkv, (hq // hkv) * q.shape[2], q.shape[3])
        o = attend_folded(qf, kv[i, 0, :, :kv_len][None], kv[i, 1, :, :kv_len][None], masks[cfg.layer_types[i]],
                          None).reshape(q.shape)
        h = blocks.draft_out(layer, fl.wgu if fl else None, h, o)
    return layer_ops.rms_norm(d.norm, h)


PLAIN_DRAFT_BLOCKS = DraftBlocks(draft_qkv=draft_qkv_block, draft_out=draft_out_block)

# Last: the engine package imports this module, so these resolve once the names above exist (whichever is imported first).
from draftforge.engine import layer_ops  # noqa: E402
from draftforge.engine.blocks import attend_folded  # noqa: E402
