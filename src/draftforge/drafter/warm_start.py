"""Warm start: copy target decoder-layer weights into the (same-width) draft layers.

Reads only the needed tensors from the target's safetensors (never loads the whole target).
Target layers without q/k norms (Llama) leave the draft's q_norm/k_norm at ones. Hybrid targets
(Qwen3.5 / Qwen3-Next): only their full-attention layers are sources; their gated q_proj keeps the
query half of each head, and their zero-centred RMSNorm weights w (applied as 1 + w) become 1 + w.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftforge.drafter.export import LAYER_KEYS, open_weights
from draftforge.drafter.model import DFlashDrafter
from draftforge.errors import StageError

_OPTIONAL = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}


def tensor_locations(hf_dir: str | Path) -> dict[str, Path]:
    """Tensor name → safetensors file, from model.safetensors.index.json or the single file."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: hf_dir / fname for name, fname in weight_map.items()}
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise StageError(f"{hf_dir}: no *.safetensors weights in the target folder")
    out: dict[str, Path] = {}
    for f in files:
        with open_weights(f) as fh:
            out.update({name: f for name in fh.keys()})
    return out


def read_tensors(hf_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read exactly `names` (missing ones are skipped; the caller checks)."""
    where = tensor_locations(hf_dir)
    by_file: dict[Path, list[str]] = {}
    for name in names:
        if name in where:
            by_file.setdefault(where[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for f, group in by_file.items():
        with open_weights(f) as fh:
            out.update({name: fh.get_tensor(name) for name in group})
    return out


ZERO_CENTRED_NORM_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def target_text_config(hf_dir: str | Path) -> dict:
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    return config.get("text_config") or config


def default_source_layers(target_num_layers: int, draft_layers: int, layer_types: list[str] | None = None) -> list[int]:
    """The target's last `draft_layers` attention layers (closest to the output distribution)."""
    attention = [i for i in range(target_num_layers) if not layer_types or layer_types[i] != "linear_attention"]
    if len(attention) < draft_layers:
        raise StageError(f"warm start: the target has {len(attention)} attention layers for {draft_layers} draft layers")
    return attention[-draft_layers:]


def _adapt(name: str, t: torch.Tensor, gated_q: bool, zero_centred: bool, head_dim: int) -> torch.Tensor:
    """A target tensor in the draft layer's convention (plain RMSNorm weight, ungated q_proj)."""
    if gated_q and name.endswith("self_attn.q_proj.weight"):
        t = t.view(-1, 2 * head_dim, t.shape[-1])[:, :head_dim].reshape(-1, t.shape[-1])  # query half per head
    if zero_centred and name.endswith("norm.weight"):
        t = 1.0 + t.float()
    return t


@torch.no_grad()
def init_from_target(model: DFlashDrafter, hf_dir: str | Path, source_layers: list[int] | None = None) -> list[int]:
    """Copy target layers `source_layers[i]` into draft layer i (and the final norm); returns the layers used."""
    cfg = model.cfg
    tcfg = target_text_config(hf_dir)
    source_layers = source_layers or default_source_layers(cfg.target_num_layers, cfg.num_hidden_layers,
                                                            tcfg.get("layer_types"))
    if len(source_layers) != cfg.num_hidden_layers:
        raise ValueError(f"init_from_target: {len(source_layers)} source layers for {cfg.num_hidden_layers} draft layers")
    zero_centred = tcfg.get("model_type") in ZERO_CENTRED_NORM_TYPES
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in tensor_locations(hf_dir)) \
        else "model."
    wanted = [f"{prefix}layers.{src}.{t}" for src in source_layers for t in LAYER_KEYS]
    found = read_tensors(hf_dir, wanted)
    q0 = found.get(f"{prefix}layers.{source_layers[0]}.self_attn.q_proj.weight")
    gated_q = q0 is not None and q0.shape[0] == 2 * cfg.num_attention_heads * cfg.head_dim
    found = {n: _adapt(n, t, gated_q, zero_centred, cfg.head_dim) for n, t in found.items()}
    params = dict(model.named_parameters())
    for i, src in enumerate(source_layers):
        for t in LAYER_KEYS:
            name = f"{prefix}layers.{src}.{t}"
            if name not in found:
                if t in _OPTIONAL:
                    continue
                raise StageError(f"{hf_dir}: tensor {name} missing (warm start needs the target's decoder layers)")
            dest = params[f"layers.{i}.{t}"]
            if dest.shape != found[name].shape:
                raise StageError(f"{hf_dir}: {name} has shape {tuple(found[name].shape)}, draft expects {tuple(dest.shape)}")
            dest.copy_(found[name].to(dest.dtype))
    # The draft output meets the target's LM head: start from the target's own final norm.
    final = read_tensors(hf_dir, [f"{prefix}norm.weight"]).get(f"{prefix}norm.weight")
    if final is not None:
        final = _adapt("norm.weight", final, False, zero_centred, cfg.head_dim)
    if final is not None and final.shape == model.norm.weight.shape:
        model.norm.weight.copy_(final.to(model.norm.weight.dtype))
    return source_layers
