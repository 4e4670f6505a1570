"""Target wrapper: runs an HF Llama/Qwen3 causal LM layer by layer over our own static KV cache.

We call the HF modules' weights (projections, norms, MLP, rotary table) but own the attention and
the cache, so cache semantics never drift with transformers versions and tree verification can pass
an arbitrary additive mask. Layer id L = output of decoder layer L (HF hidden_states[L+1]); the
tapped layers are collected during the same pass, never all layers.

Invariant: `cache.length` rows of every layer's K/V hold the committed prefix (rotary already
applied at each row's position id); rows past `length` are scratch and get overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")


@dataclass
class TargetModel:
    hf: nn.Module  # the HF CausalLM (frozen, eval)
    embed: nn.Module
    layers: Sequence[nn.Module]
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tap_ids: tuple[int, ...] = ()
    qk_norm: bool = False
    _tap_pos: dict[int, int] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed.weight.shape[1]


def wrap_target(model: nn.Module, tap_ids: Sequence[int] = ()) -> TargetModel:
    """Wrap a loaded HF causal LM; tap_ids are 0-based decoder-layer outputs to capture."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"engine target: model_type {model_type!r} not supported (use one of {SUPPORTED_MODEL_TYPES})")
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("engine target: sliding-window / non-full-attention layers are not supported")
    base = model.model
    n_layers = len(base.layers)
    taps = tuple(int(t) for t in tap_ids)
    if any(not 0 <= t < n_layers for t in taps):
        raise ValueError(f"engine target: tap ids {taps} outside [0, {n_layers - 1}]")
    attn0 = base.layers[0].self_attn
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return TargetModel(
        hf=model,
        embed=base.embed_tokens,
        layers=list(base.layers),
        norm=base.norm,
        lm_head=model.lm_head,
        rotary=base.rotary_emb,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        tap_ids=taps,
        qk_norm=hasattr(attn0, "q_norm"),
        _tap_pos={t: i for i, t in enumerate(taps)},
    )


class KVCache:
    """Static K/V buffer (layers, 2, n_kv, capacity, hd) with a committed length.

    One tensor for all layers, so compaction is a single gather + copy however deep the model is.
    `k[i]` / `v[i]` are (1, n_kv, capacity, hd) views of layer i.
    """

    def __init__(self, tm: TargetModel, capacity: int) -> None:
        self.buf = torch.empty(len(tm.layers), 2, tm.num_kv_heads, capacity, tm.head_dim, device=tm.device, dtype=tm.dtype)
        self.length = 0
        self._views()

    def _views(self) -> None:
        self.k = [self.buf[i, 0][None] for i in range(self.buf.shape[0])]
        self.v = [self.buf[i, 1][None] for i in range(self.buf.shape[0])]

    @property
    def capacity(self) -> int:
        return self.buf.shape[3]

    def ensure(self, n: int) -> None:
        """Room for n more rows after `length` (grows by doubling; keeps the committed rows)."""
        need = self.length + n
        if need <= self.capacity:
            return
        old = self.buf
        shape = list(old.shape)
        shape[3] = max(need, 2 * self.capacity)
        self.buf = old.new_empty(shape)
        self.buf[:, :, :, : self.length] = old[:, :, :, : self.length]
        self._views()

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"KVCache.crop({n}): cache holds {self.length} rows")
        self.length = n

    def compact(self, rows: torch.Tensor, dst: int) -> None:
        """Move rows (long, ascending, every row >= dst) to dst..dst+len-1, then crop after them.

        Used after tree verification: keep the accepted path's rows contiguously after the past.
        """
        m = rows.shape[0]
        self.buf[:, :, :, dst : dst + m] = self.buf.index_select(3, rows)  # gather first: rows may overlap
        self.length = dst + m


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(tm: TargetModel, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (n,) → cos, sin (1, 1, n, hd) from the HF rotary module (handles rope scaling)."""
    probe = torch.empty(1, device=tm.device, dtype=tm.dtype)
    cos, sin = tm.rotary(probe, positions[None])  # (1, n, hd)
    return cos[:, None], sin[:, None]


def causal_mask(past: int, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive (1, 1, n, past+n): query j sees rows < past + j + 1. None for n == 1 (sees all)."""
    if n == 1:
        return None
    cols = torch.arange(past + n, device=device)
    rows = torch.arange(n, device=device)[:, None] + past
    return torch.zeros((), device=device, dtype=dtype).masked_fill(cols[None, :] > rows, float("-inf"))[None, None]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA. Without a mask (one decode token) GQA goes to the flash kernel via enable_gqa; with a
    mask, K/V heads are expanded so CUDA can use the memory-efficient kernel (GQA + mask would fall
    back to the math kernel). Same math either way."""
    group = q.shape[1] // k.shape[1]
    if mask is None or group == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    b, h, L, d = k.shape
    k = k[:, :, None].expand(b, h, group, L, d).reshape(b, h * group, L, d)
    v = v[:, :, None].expand(b, h, group, L, d).reshape(b, h * group, L, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@torch.no_grad()
def forward(
    tm: TargetModel,
    cache: KVCache,
    ids: torch.Tensor,  # (1, n) int64
    positions: torch.Tensor,  # (n,) int64 rotary position of each token
    mask: torch.Tensor | None | str = "causal",  # additive (1, 1, n, length+n) | None (all) | "causal"
    want_taps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Append n tokens at cache rows length..length+n-1 and run the target over them.

    Returns the final-normed hidden states (1, n, H) (logits = tm.lm_head(h)) and, when want_taps,
    the tapped layers' outputs concatenated in tap order (1, n, n_taps*H).
    """
    n = ids.shape[1]
    past = cache.length
    cache.ensure(n)
    end = past + n
    if isinstance(mask, str):
        mask = causal_mask(past, n, tm.device, tm.dtype)
    cos, sin = rope_tables(tm, positions)
    taps: list[torch.Tensor | None] = [None] * len(tm.tap_ids)
    h = tm.embed(ids)  # (1, n, H)
    for i, layer in enumerate(tm.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(1, n, tm.num_heads, tm.head_dim)
        k = attn.k_proj(x).view(1, n, tm.num_kv_heads, tm.head_dim)
        v = attn.v_proj(x).view(1, n, tm.num_kv_heads, tm.head_dim)
        if tm.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (1, heads, n, hd)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.k[i][:, :, past:end] = k
        cache.v[i][:, :, past:end] = v
        o = _attend(q, cache.k[i][:, :, :end], cache.v[i][:, :, :end], mask, attn.scaling)  # (1, heads, n, hd)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(1, n, tm.num_heads * tm.head_dim))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        slot = tm._tap_pos.get(i)
        if slot is not None and want_taps:
            taps[slot] = h
    cache.length = end
    tapped = torch.cat(taps, dim=-1) if want_taps and taps else None  # type: ignore[arg-type]
    return tm.norm(h), tapped


def logits_of(tm: TargetModel, h: torch.Tensor) -> torch.Tensor:
    """(…, H) final-normed states → (…, V) logits."""
    return tm.lm_head(h)


def embed_tokens(tm: TargetModel, ids: Any) -> torch.Tensor:
    """A list/tensor of ids → (1, n, H) target embeddings (the drafter's block input)."""
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=tm.device, dtype=torch.long)
    return tm.embed(t.view(1, -1))
