"""MTP head: one decoder layer over a projection of [norm(token embedding); norm(target hidden state)].

The DeepSeek-V3 / MiMo / Qwen3.5 multi-token-prediction form (docs/architecture.md, "MTP head"). For
pair index i (the target's position i):

    x_i  = proj(cat[hnorm(h_i), enorm(E[t_{i+1}])])      "mimo" order (hidden first; E zeroed at position 0)
    x_i  = proj(cat[enorm(E[t_{i+1}]), hnorm(h_i)])      "qwen3_5" order (embedding first)
    o_i  = final_norm(layer(x_i at position i))           logits = target LM head(o_i) predict t_{i+2}

h_i is the target's final-normed last-layer state (what vLLM hands its MTP proposer). Applied
recursively, depth d+1 takes o (depth d's output) as its hidden state, the depth-d draft as its token,
at one position later; its attention sees the context pairs plus the deeper entries of its own chain.

One forward code path (`MTPHead.forward`) serves training (whole sequences, causal, optional extra
keys for recursive depths) and the engine (a small KV cache over context positions), so the two agree.
The layer, norms and rotary table are the HF modules of a family ("qwen2" for trained heads, the
target's own family for native ones): their weights load by name.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.drafter.mtp_format import HEAD_CONFIG, MTP_TARGET_OVERRIDES, TRAINED_DEFAULT_DRAFTS  # noqa: F401
from draftforge.drafter.rope import rotary_tables

FORMS = ("mimo", "qwen3_5")
# model_type → (transformers package, decoder layer, RMSNorm, rotary embedding)
FAMILIES = {
    "qwen2": ("qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm", "Qwen2RotaryEmbedding"),
    "llama": ("llama", "LlamaDecoderLayer", "LlamaRMSNorm", "LlamaRotaryEmbedding"),
    "qwen3": ("qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm", "Qwen3RotaryEmbedding"),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5RMSNorm", "Qwen3_5TextRotaryEmbedding"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeRMSNorm", "Qwen3_5MoeTextRotaryEmbedding"),
    "qwen3_next": ("qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextRMSNorm", "Qwen3NextRotaryEmbedding"),
}
FAMILIES["qwen3_5"] = FAMILIES["qwen3_5_text"]
FAMILIES["qwen3_5_moe"] = FAMILIES["qwen3_5_moe_text"]
# head parameter prefix ↔ checkpoint names per serving format (layer.* keeps the HF layer's own names)
MIMO_NAMES = {"enorm.": "token_layernorm.", "hnorm.": "hidden_layernorm.", "proj.": "input_proj.",
              "final_norm.": "final_layernorm.", "layer.": ""}
QWEN3_5_NAMES = {"enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden.", "proj.": "fc.",
                 "final_norm.": "norm.", "layer.": "layers.0."}


def family_classes(model_type: str) -> tuple[type, type, type]:
    if model_type not in FAMILIES:
        raise ValueError(f"mtp: no MTP layer family for model_type {model_type!r} (known: {sorted(FAMILIES)})")
    pkg, layer, norm, rope = FAMILIES[model_type]
    mod = importlib.import_module(f"transformers.models.{pkg}.modeling_{pkg}")
    return getattr(mod, layer), getattr(mod, norm), getattr(mod, rope)


@dataclass
class KV:
    """Context-only KV cache of the head's one attention layer: (1, kv_heads, L, head_dim) each."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def crop(self, n: int) -> None:
        if self.k is not None and self.k.shape[2] > n:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class MTPHead(nn.Module):
    """One MTP layer. `config` is an HF config of the layer's family (text config for Qwen3.5)."""

    def __init__(self, config: Any, form: str = "mimo", source: str = "trained") -> None:
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"mtp: form {form!r} not in {FORMS}")
        self.config, self.form, self.source = config, form, source
        layer_cls, norm_cls, rope_cls = family_classes(config.model_type)
        H, eps = config.hidden_size, config.rms_norm_eps
        types = list(getattr(config, "layer_types", None) or [])
        idx = types.index("full_attention") if "full_attention" in types else 0
        self.layer = layer_cls(config, idx)
        if not hasattr(self.layer, "self_attn"):
            raise ValueError(f"mtp: {layer_cls.__name__} at layer {idx} has no attention")
        self.enorm, self.hnorm, self.final_norm = norm_cls(H, eps=eps), norm_cls(H, eps=eps), norm_cls(H, eps=eps)
        self.proj = nn.Linear(2 * H, H, bias=False)
        self.rotary = rope_cls(config=config)
        attn = self.layer.self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or H // self.num_heads
        self.gated = attn.q_proj.out_features == 2 * self.num_heads * self.head_dim
        self.qk_norm = hasattr(attn, "q_norm")

    @property
    def hidden_size(self) -> int:
        return self.proj.out_features

    def new_cache(self) -> KV:
        return KV()

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (S, n) → cos, sin (S, 1, n, rot)."""
        cos, sin = rotary_tables(self.rotary, like, positions)
        return cos[:, None].to(like.dtype), sin[:, None].to(like.dtype)

    def inputs(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The layer's input x = proj(...) for (S, n, H) hidden states and next-token embeddings."""
        if self.form == "mimo":
            embeds = torch.where((positions == 0)[..., None], torch.zeros_like(embeds), embeds)
            return self.proj(torch.cat([self.hnorm(hidden), self.enorm(embeds)], dim=-1))
        return self.proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """(S, n, H) normed input → q (S, heads, n, hd), k, v (S, kv, n, hd) after RoPE, gate or None."""
        attn, S, n, hd = self.layer.self_attn, x.shape[0], x.shape[1], self.head_dim
        qg = attn.q_proj(x)
        gate = None
        if self.gated:
            qg = qg.view(S, n, self.num_heads, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(S, n, self.num_heads * hd)
        else:
            q = qg.view(S, n, self.num_heads, hd)
        k = attn.k_proj(x).view(S, n, self.num_kv_heads, hd)
        v = attn.v_proj(x).view(S, n, self.num_kv_heads, hd)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = self.rope(positions, x)
        return _rope(q, cos, sin), _rope(k, cos, sin), v, gate

    def attend(self, q, k, v, mask, gate) -> torch.Tensor:
        attn, S, n = self.layer.self_attn, q.shape[0], q.shape[2]
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        o = o.transpose(1, 2).reshape(S, n, self.num_heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return attn.o_proj(o)

    def block(self, x: torch.Tensor, positions: torch.Tensor, keys=None, mask=None, cache: KV | None = None,
              keep: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoder layer + final norm over x (S, n, H) at positions (S, n).

        Attention keys: `keys` = (k, v) prepended (training's recursive depths, with `mask`), or the
        cache's entries (engine; the new entries are appended when keep). Returns (out, k, v)."""
        h = self.layer.input_layernorm(x)
        q, k, v, gate = self.qkv(h, positions)
        kk, vv = k, v
        if cache is not None and cache.k is not None:
            kk, vv = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        elif keys is not None:
            kk, vv = torch.cat([keys[0], k], dim=2), torch.cat([keys[1], v], dim=2)
        n, L = q.shape[2], kk.shape[2]
        if mask is None and n > 1:  # causal, aligned at the end (the new rows are the last n keys)
            mask = torch.ones(n, L, dtype=torch.bool, device=x.device).tril(L - n)
        if cache is not None and keep:
            cache.k, cache.v = kk, vv
        x = x + self.attend(q, kk, vv, mask, gate)
        out = self.layer.mlp(self.layer.post_attention_layernorm(x))
        x = x + (out[0] if isinstance(out, tuple) else out)
        return self.final_norm(x), k, v

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, *, keys=None,
                mask=None, cache: KV | None = None, keep: bool = True):
        """Full step: hidden, embeds (S, n, H), positions (S, n) → (out (S, n, H), k, v)."""
        x = self.inputs(hidden, embeds, positions)
        return self.block(x, positions, keys, mask, cache, keep)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    half = rot // 2
    xr = x[..., :rot]
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos + rotated * sin
    return out if rot == x.shape[-1] else torch.cat([out, x[..., rot:]], dim=-1)


# ---- construction, native weights, export ---------------------------------------------------------
def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config") or cfg


def native_mtp_format(hf_dir: str | Path) -> str | None:
    """"mimo" (model.mtp_layers.*), "qwen3_5" (mtp.*) or None: which MTP layers a checkpoint carries."""
    from draftforge.drafter.warm_start import tensor_locations

    names = tensor_locations(hf_dir)
    if any(n.startswith("model.mtp_layers.0.") for n in names):
        return "mimo"
    if any(n.startswith("mtp.layers.0.") for n in names):
        return "qwen3_5"
    return None


def _hf_config(model_type: str, cfg: dict[str, Any]):
    from transformers import AutoConfig

    plain = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "auto_map", "transformers_version")}
    return AutoConfig.for_model(model_type, **plain)


def load_mtp_head(hf_dir: str | Path, *, source: str | None = None, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> MTPHead:
    """The first MTP layer of a checkpoint: a target with native MTP layers, or a trained head's export.

    "mimo": Qwen2 layer, names model.mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj,
    final_layernorm, <Qwen2 layer>}; "qwen3_5": the text family's full-attention layer, names
    mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm, layers.0.<layer>}."""
    from draftforge.drafter.warm_start import read_tensors

    hf_dir = Path(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    form = native_mtp_format(hf_dir)
    if form is None:
        raise ValueError(f"{hf_dir}: no MTP layers (model.mtp_layers.* or mtp.*) in the safetensors")
    if form == "mimo":
        config, prefix, names = _hf_config("qwen2", raw), "model.mtp_layers.0.", MIMO_NAMES
    else:
        text = _text_config(raw)
        config, prefix, names = _hf_config(text.get("model_type", "qwen3_5_text"), text), "mtp.", QWEN3_5_NAMES
    if source is None:
        source = "trained" if (hf_dir / HEAD_CONFIG).is_file() else "native"
    head = MTPHead(config, form, source)
    want = {}
    for pname in head.state_dict():
        for ours, theirs in names.items():
            if pname.startswith(ours):
                want[prefix + theirs + pname[len(ours):]] = pname
                break
    found = read_tensors(hf_dir, list(want))
    missing = [n for n in want if n not in found]
    if missing:
        raise ValueError(f"{hf_dir}: MTP tensors missing: {missing[:4]}{' …' if len(missing) > 4 else ''}")
    head.load_state_dict({want[n]: t for n, t in found.items()}, strict=True)
    return head.to(device=device, dtype=dtype).eval()


TRAINED_LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                      "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                      "input_layernorm.weight", "post_attention_layernorm.weight")
_QWEN2_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
               "hidden_act", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def trained_head_config(target: str | Path | dict[str, Any]):
    """A Qwen2 layer config of the target's width (the layer vLLM's MiMo MTP serves); `target` is its
    HF folder or config dict."""
    where = target if not isinstance(target, dict) else "target config"
    raw = _text_config(target if isinstance(target, dict) else json.loads((Path(target) / "config.json").read_text()))
    heads, H = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    kv = int(raw.get("num_key_value_heads") or heads)
    hd = int(raw.get("head_dim") or H // heads)
    plain = {k: raw[k] for k in _QWEN2_KEYS if k in raw}
    if hd * heads != H:  # a Qwen2 layer has head_dim = hidden / heads: keep the target's head_dim, fewer heads
        if H % hd:
            raise ValueError(f"{where}: trained MTP head needs hidden {H} divisible by head_dim {hd}")
        heads = H // hd
        kv = max(d for d in range(1, min(kv, heads) + 1) if heads % d == 0)
        plain.update(num_attention_heads=heads, num_key_value_heads=kv)
    plain.update(num_hidden_layers=1, use_sliding_window=False, sliding_window=None, attention_dropout=0.0)
    return _hf_config("qwen2", plain)


@torch.no_grad()
def new_trained_head(target_hf_dir: str | Path, *, init_from_target: bool = True, seed: int = 0) -> tuple[MTPHead, int | None]:
    """A fresh MiMo-form head for a target without MTP layers; its layer starts as a copy of the
    target's last decoder layer (attention and MLP; biases at zero) when the shapes match.
    Returns (head, the copied target layer or None)."""
    from draftforge.drafter.warm_start import read_tensors

    torch.manual_seed(seed)
    config = trained_head_config(target_hf_dir)
    head = MTPHead(config, "mimo", "trained")
    for name, p in head.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
    raw = _text_config(json.loads((Path(target_hf_dir) / "config.json").read_text()))
    last = int(raw["num_hidden_layers"]) - 1
    if not init_from_target:
        return head, None
    for prefix in ("model.layers.", "model.language_model.layers."):
        found = read_tensors(target_hf_dir, [f"{prefix}{last}.{k}" for k in TRAINED_LAYER_KEYS])
        if len(found) == len(TRAINED_LAYER_KEYS):
            params = dict(head.layer.named_parameters())
            if all(params[k].shape == found[f"{prefix}{last}.{k}"].shape for k in TRAINED_LAYER_KEYS):
                for k in TRAINED_LAYER_KEYS:
                    params[k].copy_(found[f"{prefix}{last}.{k}"].float())
                return head, last
    return head, None


def export_mimo_head(head: MTPHead, out_dir: str | Path, target_hf_dir: str | Path, *,
                     dtype: torch.dtype = torch.bfloat16, extra: dict[str, Any] | None = None) -> Path:
    """Write a trained head in vLLM's MiMo MTP checkpoint format (servable with
    speculative_config `{method: mtp, model: out_dir}`): config.json (MiMoForCausalLM,
    num_nextn_predict_layers 1), model.safetensors with model.mtp_layers.0.* plus the target's
    embedding and LM head (vLLM loads both, then shares the target's), and mtp_head.json."""
    from safetensors.torch import save_file

    from draftforge.drafter.warm_start import read_tensors
    from draftforge.io import atomic_dir, write_json
    from draftforge.train.head import EMBED_NAMES

    if head.form != "mimo" or head.config.model_type != "qwen2":
        raise ValueError("export_mimo_head: only a MiMo-form head with a Qwen2 layer")
    found = read_tensors(target_hf_dir, [*EMBED_NAMES, "lm_head.weight"])
    embed = next((found[n] for n in EMBED_NAMES if n in found), None)
    if embed is None:
        raise ValueError(f"{target_hf_dir}: no embedding table in the target's safetensors")
    head_w = found.get("lm_head.weight", embed)  # a tied target stores one table: write two copies
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": head_w.clone() if head_w is embed else head_w}
    for pname, t in head.state_dict().items():
        for ours, theirs in MIMO_NAMES.items():
            if pname.startswith(ours):
                tensors["model.mtp_layers.0." + theirs + pname[len(ours):]] = t
                break
    tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in tensors.items()}
    cfg = head.config.to_dict()
    cfg.update(architectures=["MiMoForCausalLM"], model_type="qwen2", num_nextn_predict_layers=1,
               tie_word_embeddings=False, torch_dtype=str(dtype).removeprefix("torch."))
    cfg.pop("dtype", None)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")
        write_json(Path(tmp) / HEAD_CONFIG, {"form": "mimo", "layer": "qwen2", "source": "trained", **(extra or {})})
    return out_dir


def wants_trained_head(info: dict[str, Any]) -> bool:
    """An mtp branch trains a head when the target has no MTP layers of its own."""
    return int(info.get("mtp_layers") or 0) == 0
