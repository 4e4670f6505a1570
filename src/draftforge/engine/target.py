"""Target wrapper: runs an HF causal LM layer by layer over the engine's own state (`state.py`).

We call the HF modules' weights (projections, norms, MLP/MoE, rotary table) but own attention, the GDN
recurrence and every cache, so cache semantics never drift with transformers versions and a verify
span can be any tree. Layer id L = output of decoder layer L (HF hidden_states[L+1]); the tapped
layers are collected during the same pass, never all layers.

Supported: dense attention (llama, mistral, qwen2, qwen3) and hybrid Gated-DeltaNet targets (qwen3_5
text, qwen3_5_moe, qwen3_next): gated full attention with partial rotary, GDN layers (`gdn.py`), dense or
MoE MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.engine import gdn
from draftforge.engine.span import Span
from draftforge.engine.state import TargetState

DENSE_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + HYBRID_MODEL_TYPES


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
    gated_attention: bool = False  # Qwen3.5/Next: q_proj also yields a sigmoid output gate
    kinds: tuple[str, ...] = ()  # per layer: "attention" | "gdn"
    slots: tuple[int, ...] = ()  # per layer: its index among the layers of its kind (state rows)
    gdn: gdn.GDNShape | None = None
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

    @property
    def hybrid(self) -> bool:
        return self.gdn is not None

    @property
    def conv_kernel(self) -> int:
        return self.gdn.conv_kernel if self.gdn else 0


def _kind(layer: nn.Module) -> str:
    if hasattr(layer, "linear_attn"):
        return "gdn"
    if hasattr(layer, "self_attn"):
        return "attention"
    raise ValueError(f"engine target: decoder layer {type(layer).__name__} has neither self_attn nor linear_attn")


def wrap_target(model: nn.Module, tap_ids: Sequence[int] = ()) -> TargetModel:
    """Wrap a loaded HF causal LM; tap_ids are 0-based decoder-layer outputs to capture."""
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    model_type = getattr(cfg, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"engine target: model_type {model_type!r} not supported (use one of {SUPPORTED_MODEL_TYPES})")
    layer_types = [t for t in (getattr(cfg, "layer_types", None) or []) if t not in ("full_attention", "linear_attention")]
    if getattr(cfg, "use_sliding_window", False) or layer_types:
        raise ValueError(f"engine target: sliding-window layers are not supported ({sorted(set(layer_types))})")
    base = model.model.language_model if hasattr(model.model, "language_model") else model.model
    n_layers = len(base.layers)
    taps = tuple(int(t) for t in tap_ids)
    if any(not 0 <= t < n_layers for t in taps):
        raise ValueError(f"engine target: tap ids {taps} outside [0, {n_layers - 1}]")
    kinds = tuple(_kind(layer) for layer in base.layers)
    counters = {"attention": 0, "gdn": 0}
    slots = []
    for k in kinds:
        slots.append(counters[k])
        counters[k] += 1
    first_attn = next(layer.self_attn for layer, k in zip(base.layers, kinds) if k == "attention")
    first_gdn = next((layer.linear_attn for layer, k in zip(base.layers, kinds) if k == "gdn"), None)
    if first_gdn is not None and first_gdn.conv1d.bias is not None:
        raise ValueError("engine target: GDN conv with a bias is not supported")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gated = first_attn.q_proj.out_features == 2 * cfg.num_attention_heads * head_dim
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
        qk_norm=hasattr(first_attn, "q_norm"),
        gated_attention=gated,
        kinds=kinds,
        slots=tuple(slots),
        gdn=gdn.gdn_shape(first_gdn) if first_gdn is not None else None,
        _tap_pos={t: i for i, t in enumerate(taps)},
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(tm: TargetModel, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (n,) → cos, sin (1, 1, n, rot) from the HF rotary module (handles scaling, partial rotary)."""
    probe = torch.empty(1, device=tm.device, dtype=tm.dtype)
    pos = positions[None]  # (1, n)
    if hasattr(tm.rotary, "mrope_section"):  # Qwen3.5 text: multimodal rope over (3, 1, n), text = 3 equal rows
        pos = pos[None].expand(3, 1, -1)  # (older transformers do not expand a (1, n) input themselves)
    cos, sin = tm.rotary(probe, pos)  # (1, n, rot)
    return cos[:, None], sin[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (1, heads, n, hd); rotary on the first `rot` dims (rot = hd unless partial), the rest passes."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat([xr * cos + _rotate_half(xr) * sin, xp], dim=-1)


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


def attend_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """GQA without expanding K/V: q (1, Hq, n, hd) → (1, Hkv, g·n, hd) against k, v (1, Hkv, L, hd)."""
    _, hq, n, hd = q.shape
    hkv = k.shape[1]
    qf = q.reshape(1, hkv, (hq // hkv) * n, hd)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
    return o.reshape(1, hq, n, hd)


def project_qkv(tm: TargetModel, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (1, n, H) normed → q (1, heads, n, hd), k, v (1, kv_heads, n, hd) with rotary, output gate or None."""
    return split_heads(attn, attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), cos, sin, tm.num_heads,
                       tm.num_kv_heads, tm.head_dim, tm.qk_norm, tm.gated_attention)


def attention_out(attn: nn.Module, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """o (1, heads, n, hd) → (1, n, H): output gate (gated attention) and o_proj."""
    _, hq, n, hd = o.shape
    o = o.transpose(1, 2).reshape(1, n, hq * hd)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return attn.o_proj(o)


def _attention(tm: TargetModel, attn: nn.Module, x: torch.Tensor, kv: torch.Tensor, past: int,
               span: Span, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One attention mixer: x (1, n, H) normed → (1, n, H); writes K/V of the span at rows past..past+n−1."""
    q, k, v, gate = project_qkv(tm, attn, x, cos, sin)
    end = past + span.n
    kv[0, :, past:end] = k[0]
    kv[1, :, past:end] = v[0]
    o = _attend(q, kv[0, :, :end][None], kv[1, :, :end][None], span.mask, attn.scaling)  # (1, heads, n, hd)
    return attention_out(attn, o, gate)


def mlp(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = layer.mlp(x)
    return out[0] if isinstance(out, tuple) else out  # some MoE blocks also return router logits


@torch.no_grad()
def forward(tm: TargetModel, state: TargetState, span: Span, want_taps: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the target over a span written after the committed rows; the caller then commits.

    Returns the final-normed hidden states (1, n, H) (logits = tm.lm_head(h)) and, when want_taps,
    the tapped layers' outputs concatenated in tap order (1, n, n_taps*H).
    """
    n = span.n
    past = state.length
    state.reserve(n)
    cos, sin = rope_tables(tm, span.positions)
    taps: list[torch.Tensor | None] = [None] * len(tm.tap_ids)
    h = tm.embed(span.ids)  # (1, n, H)
    for i, layer in enumerate(tm.layers):
        x = layer.input_layernorm(h)
        s = tm.slots[i]
        if tm.kinds[i] == "attention":
            h = h + _attention(tm, layer.self_attn, x, state.kv[s], past, span, cos, sin)
        else:
            out, state.scratch[s] = gdn.mix(layer.linear_attn, x, state.conv[s], state.rec[s], span.depths,
                                            span.anc, span.anc_at, span.commit_all)
            h = h + out
        h = h + mlp(layer, layer.post_attention_layernorm(h))
        slot = tm._tap_pos.get(i)
        if slot is not None and want_taps:
            taps[slot] = h
    if span.commit_all:
        state.commit_all()
    tapped = torch.cat(taps, dim=-1) if want_taps and taps else None  # type: ignore[arg-type]
    return tm.norm(h), tapped


def embed_tokens(tm: TargetModel, ids: Any) -> torch.Tensor:
    """A list/tensor of ids → (1, n, H) target embeddings (the drafter's block input)."""
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=tm.device, dtype=torch.long)
    return tm.embed(t.view(1, -1))
