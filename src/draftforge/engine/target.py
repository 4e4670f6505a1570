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
from torch import nn

from draftforge.drafter.rope import rotary_tables
from draftforge.engine import gdn, layer_ops, split_attention
from draftforge.engine.blocks import FusedLayer, attend, fold_mask
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
    runtime: Any = None  # LayerRuntime of the eager engine, for `runtime_at`'s placement (see eager_runtime)
    runtime_at: tuple[torch.device, torch.dtype] | None = None

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
    tm = TargetModel(
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
    eager_runtime(tm)
    return tm


def eager_runtime(tm: TargetModel) -> LayerRuntime:
    """The eager engine's LayerRuntime for where the model is now; built on first use and again after the model
    moved (`tm.hf.to(device or dtype)`), so no engine reads weights fused for another placement. Weights changed
    in place (an in-place update, `load_state_dict`) reach the fused tensors through their views; a Linear
    parameter replaced by another object at the same placement is not seen here: wrap the model again.

    On a CPU in fp32: q/k/v and gate/up fused, every product on its measured route (engine/cpu_linear.py).
    Elsewhere: the HF projections one by one (the captured engine fuses its own, engine/fused.py)."""
    at = (tm.device, tm.dtype)
    if tm.runtime is not None and tm.runtime_at == at:
        return tm.runtime
    from draftforge.engine import cpu_linear
    from draftforge.engine.fused import fuse_projections, plain_blocks

    fused = [FusedLayer() for _ in tm.kinds]
    if at == (torch.device("cpu"), torch.float32):
        fused = fuse_projections(tm)
        for fl in fused:
            for w in (fl.wqkv, fl.wgu):
                if w is not None:
                    cpu_linear.register(w)
    cpu_linear.route_linears(tm.hf)  # a no-op off the CPU
    tm.runtime, tm.runtime_at = LayerRuntime(fused=fused, blocks=plain_blocks()), at
    return tm.runtime


def rope_tables(tm: TargetModel, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (n,) → cos, sin (1, 1, n, rot) from the HF rotary module (handles scaling, partial rotary)."""
    probe = torch.empty(1, device=tm.device, dtype=tm.dtype)
    cos, sin = rotary_tables(tm.rotary, probe, positions[None])  # (1, n, rot)
    return cos[:, None], sin[:, None]


@dataclass
class Step:
    """One forward over a span, as the layers read it (built by the eager `forward` or a captured bucket)."""

    ids: torch.Tensor  # (1, n) token ids
    positions: torch.Tensor  # (n,) rotary positions
    slots: torch.Tensor  # (n,) state rows the span's K/V are written to
    kv_len: int  # attention reads rows 0..kv_len−1 (eager: past + n; static: the whole capacity)
    mask: torch.Tensor | None  # additive over folded query rows (1, 1, g·n, kv_len); None: all visible
    causal: bool  # mask None and n > 1: a chain from row 0 (prefill), SDPA's causal rule
    gdn: gdn.GDNSpan | None  # what GDN layers read (None on attention-only targets)


@dataclass
class LayerRuntime:
    """How the layers run: fused weights per layer and the block functions (plain or compiled)."""

    fused: Sequence[FusedLayer]
    blocks: Any  # fused.LayerBlocks: qkv, post, split, mlp (plain functions or torch.compile'd)
    split_attention: bool = False  # CUDA: split-KV attention where SDPA would leave SMs idle
    gdn_mixers: bool = True  # benchmarks only: False skips GDN token mixers (their share of a step)


def run_layers(tm: TargetModel, state: TargetState, step: Step, rt: LayerRuntime,
               want_taps: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one decoder stack every engine runs: → final-normed states (1, n, H), taps (1, n, n_taps·H) | None.

    K/V of the span go to `step.slots` with `index_copy_` (outside any compiled block); attention reads
    rows < kv_len under the mask; GDN layers run the tree form (`gdn.mix`)."""
    n = step.ids.shape[1]
    blk = rt.blocks
    cos, sin = rope_tables(tm, step.positions)
    taps: list[torch.Tensor] = []
    h = tm.embed(step.ids)  # (1, n, H)
    for i, layer in enumerate(tm.layers):
        s, fl = tm.slots[i], rt.fused[i]
        if tm.kinds[i] == "attention":
            attn = layer.self_attn
            q, k, v, gate = blk.qkv(attn, layer.input_layernorm, fl.wqkv, fl.bqkv, h, cos, sin, fl.q_out, fl.kv_out,
                                    tm.num_heads, tm.num_kv_heads, tm.head_dim, tm.qk_norm, tm.gated_attention)
            kv = state.kv[s]  # (2, Hkv, cap, hd)
            kv[0].index_copy_(1, step.slots, k[0])
            kv[1].index_copy_(1, step.slots, v[0])
            kc, vc = kv[0, :, : step.kv_len][None], kv[1, :, : step.kv_len][None]
            if rt.split_attention and step.mask is not None and split_attention.usable(q, q.shape[1] // kc.shape[1] * n,
                                                                                        tm.num_kv_heads):
                kv_len = step.slots[-1:] + 1  # rows past the span's last slot are masked: the kernel stops there
                parts = split_attention.split_partials(q, kv[0], kv[1], step.mask, kv_len, attn.scaling)
                h = blk.split(layer, fl.wgu, h, *parts, gate, n)
            else:
                o = attend(q, kc, vc, step.mask, step.causal, attn.scaling)
                h = blk.post(layer, fl.wgu, h, o, gate)
        else:
            if rt.gdn_mixers:
                h = h + gdn.mix(layer.linear_attn, layer.input_layernorm(h), state.conv[s], state.rec[s], step.gdn,
                                state.scratch, s)
            h = blk.mlp(layer, fl.wgu, h)
        if want_taps and i in tm._tap_pos:
            taps.append(h)
    return layer_ops.rms_norm(tm.norm, h), (torch.cat(taps, dim=-1) if taps else None)


@torch.no_grad()
def forward(tm: TargetModel, state: TargetState, span: Span, want_taps: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The eager engine: run the target over a span written after the committed rows; the caller commits
    (a `commit_all` span is committed here). → final-normed states (1, n, H) (logits = tm.lm_head(h)) and,
    when want_taps, the tapped layers' outputs concatenated in tap order (1, n, n_taps·H)."""
    n, past = span.n, state.length
    state.reserve(n, verify=not span.commit_all)
    dev = span.ids.device
    group = tm.num_heads // tm.num_kv_heads
    step = Step(ids=span.ids, positions=span.positions, slots=torch.arange(past, past + n, device=dev),
                kv_len=past + n, mask=fold_mask(span.mask, group), causal=span.mask is None and past == 0,
                gdn=gdn.GDNSpan(span.depths, span.anc, span.anc_at, None, span.commit_all) if tm.hybrid else None)
    h, taps = run_layers(tm, state, step, eager_runtime(tm), want_taps)
    if span.commit_all:
        state.commit_all()
    return h, taps


def embed_tokens(tm: TargetModel, ids: Any) -> torch.Tensor:
    """A list/tensor of ids → (1, n, H) target embeddings (the drafter's block input)."""
    t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=tm.device, dtype=torch.long)
    return tm.embed(t.view(1, -1))
