"""DFlashDrafter: Qwen3-style decoder layers with KV injection of the fused tapped target features.

Per layer l (pre-norm, RMSNorm, SwiGLU, per-head RMSNorm on q and k before RoPE):
    C        = hidden_norm(fc(tapped))                  context feature, (T, H); never in the residual
    K, V     = [k_norm(Wk C) | k_norm(Wk x)], [Wv C | Wv x]   with x = input_layernorm(h_block)
    Q        = q_norm(Wq x)                              queries from the block only
RoPE is absolute: context token p at p, block slot k at anchor + k.  The target's embeddings and
LM head are not part of this module (frozen, owned by the target); a drafter with a draft vocabulary
(cfg.draft_vocab_size = D) holds the ids of its D tokens and their D rows of that head as buffers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.drafter.attention import apply_rope, attend, build_mask, resolve_impl, rope_cos_sin
from draftforge.drafter.config import SLIDING, DFlashConfig
from draftforge.drafter.inference import PLAIN_DRAFT_BLOCKS, block_pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (S, T, H) → k (S, n_kv, T, hd) normed and rotated, v (S, n_kv, T, hd)."""
        S, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(S, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(S, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # (S, Q, H) normed block states
        cos: torch.Tensor,  # (S|1, 1, Q, hd) block positions
        sin: torch.Tensor,
        ctx_k: torch.Tensor,  # (S, n_kv, T, hd)
        ctx_v: torch.Tensor,
        mask: Any,  # None (all visible) | bool (S, 1, Q, T+Q) | BlockMask
        impl: str,
    ) -> torch.Tensor:
        S, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(S, Q, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)  # (S, n_kv, T+Q, hd): same k/v weights for both parts
        v = torch.cat([ctx_v, v_blk], dim=2)
        out = attend(q, k, v, mask, impl)  # (S, n_heads, Q, hd)
        return self.o_proj(out.transpose(1, 2).reshape(S, Q, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask, impl) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask, impl)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, attn_impl: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.attn_impl = attn_impl
        self.fc = nn.Linear(cfg.feature_dim, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.draft_vocab_size:  # docs/architecture.md, "Draft vocabulary": state, not trained
            D = cfg.draft_vocab_size
            self.register_buffer("draft_ids", torch.zeros(D, dtype=torch.long))  # (D,) target id of each row, ascending
            self.register_buffer("draft_head", torch.zeros(D, cfg.hidden_size))  # (D, H) the target's LM-head rows
        self.reset_parameters()

    def set_draft_vocab(self, ids: torch.Tensor, target_lm_head: torch.Tensor) -> None:
        """ids (D,) ascending target ids, target_lm_head (V, H) → the draft head = those rows (frozen)."""
        self.draft_ids.copy_(ids)
        self.draft_head.copy_(target_lm_head[ids.to(target_lm_head.device)])

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    # ---- inference API (engine) -------------------------------------------------------------
    def project_context(self, tapped: torch.Tensor) -> torch.Tensor:
        """(S, n, n_taps*H_target) → (S, n, H): fc + hidden_norm."""
        return self.hidden_norm(self.fc(tapped.to(self.fc.weight.dtype)))

    @torch.no_grad()
    def draft(self, block_embeds: torch.Tensor, block_pos: torch.Tensor, ctx_feats: torch.Tensor,
              ctx_pos: torch.Tensor, kv: torch.Tensor, kv_len: int, blocks: Any = PLAIN_DRAFT_BLOCKS,
              fused: Any = None) -> torch.Tensor:
        """The inference block pass (drafter/inference.py) → (1, B, H) normed: the block [bonus, mask × (B−1)]
        at positions block_pos after the context features ctx_feats (1, c, F) of positions ctx_pos are written
        to the context cache kv (layers, 2, Hkv, cap, hd); blocks / fused: the engine's (plain or compiled)."""
        return block_pass(self, blocks, fused, block_embeds, block_pos, ctx_feats, ctx_pos, kv, kv_len)

    # ---- training API ---------------------------------------------------------------------
    def forward(
        self,
        tapped: torch.Tensor,  # (S, T, n_taps*H_target) context features
        block_embeds: torch.Tensor,  # (S, N*B, H) embeddings of [anchor, mask x (B-1)] per block
        anchors: torch.Tensor,  # (S, N) int64 anchor positions (padding anchors: any value in [0, T])
        attn_impl: str | None = None,
        mask: Any = None,  # prebuilt {layer type: mask} for these anchors (layer_masks); None → built here
    ) -> torch.Tensor:
        """All blocks of each sequence in one pass under the DFlash mask. Returns (S, N*B, H) normed."""
        S, T, _ = tapped.shape
        N = anchors.shape[1]
        B = block_embeds.shape[1] // N
        impl = resolve_impl(attn_impl or self.attn_impl, tapped.device)
        dtype = block_embeds.dtype
        ctx = self.project_context(tapped).to(dtype)  # (S, T, H)
        ctx_cos, ctx_sin = self._rope(torch.arange(T, device=tapped.device), dtype)  # (1, T, hd) → bcast
        blk_pos = (anchors[:, :, None] + torch.arange(B, device=anchors.device)).reshape(S, N * B)  # (S, Q)
        blk_cos, blk_sin = self._rope(blk_pos, dtype)  # (S, 1, Q, hd)
        masks = mask if mask is not None else self.layer_masks(anchors, T, impl)
        h = block_embeds
        for kind, layer in zip(self.cfg.layer_types, self.layers):
            ctx_k, ctx_v = layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin)
            h = layer(h, blk_cos, blk_sin, ctx_k, ctx_v, masks[kind], impl)
        return self.norm(h)

    def layer_masks(self, anchors: torch.Tensor, ctx_len: int, impl: str) -> dict[str, Any]:
        """One training mask per layer type present (full: the DFlash mask; sliding: windowed + causal block)."""
        B = self.cfg.block_size
        return {kind: build_mask(anchors, ctx_len, B, impl, self.cfg.sliding_window if kind == SLIDING else 0)
                for kind in set(self.cfg.layer_types)}
