"""Typed config of the target and of what it fixes for every drafter: taps and mask token (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# OmegaConf reads the literal "???" as a required (missing) value; spelled out here so this module
# (used by GPU benchmarks on machines without omegaconf) stays dependency-free.
MISSING: Any = "???"

TARGET_SOURCES = ("gguf_package", "hf_dir", "hub_cache", "random")


def _check(ok: bool, key: str, problem: str) -> None:
    """errors.check, imported lazily: this module stays dependency-free for GPU benchmark machines."""
    if not ok:
        from draftforge.errors import ConfigError

        raise ConfigError(f"{key}: {problem}")


@dataclass
class DrafterInputsConfig:
    """What the target fixes for every drafter trained on it (its shape and heads: the `drafter` group)."""

    # Row of the target's embedding table used as the mask token; never resize the vocabulary.
    mask_token_id: int = MISSING
    # 0-based "output of decoder layer i"; None → the reference rule over [1, L-3] (default_tap_ids).
    # Extract stores exactly these layers, so they belong to the target, not to one drafter.
    target_layer_ids: Optional[List[int]] = None
    n_taps: int = 5

    def __post_init__(self) -> None:
        _check(self.n_taps >= 1, "target.drafter.n_taps", f"{self.n_taps} must be >= 1")


@dataclass
class RandomTargetConfig:
    """A random-weight target built locally (tests, GPU benchmarks); tokenizer is byte-level ChatML."""

    architecture: str = "LlamaForCausalLM"  # or Qwen3ForCausalLM, Qwen3_5ForCausalLM, Qwen3NextForCausalLM
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    seed: int = 0
    # Hybrid (Qwen3.5 / Qwen3-Next): every `full_attention_interval`-th layer is gated full attention,
    # the others Gated DeltaNet; MoE sizes apply to Qwen3-Next only.
    full_attention_interval: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64


@dataclass
class TargetConfig:
    name: str = MISSING
    source: str = MISSING  # one of TARGET_SOURCES
    path: Optional[str] = None  # hf_dir: a local HF model folder
    hub_id: Optional[str] = None  # hub_cache: an id already in the local HF cache (offline)
    revision: Optional[str] = None
    package: Optional[str] = None  # gguf_package: a pip package that ships a GGUF file
    gguf_file: Optional[str] = None
    dtype: str = "bfloat16"  # compute dtype on GPU; CPU stages use float32
    architecture: Optional[str] = None  # expected architecture (checked when set)
    num_layers: Optional[int] = None  # expected layer count (checked when set)
    mtp_layers: int = 0  # MTP layers the checkpoint is expected to carry
    hybrid_attention: bool = False  # Gated-DeltaNet (linear-attention) layers present
    # Options of the target's chat template, e.g. {enable_thinking: false} (Qwen3 hybrid thinking): the chat mode
    # every stage renders conversations in (draftforge.chat.ChatMode); {} = the template's defaults.
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    drafter: DrafterInputsConfig = field(default_factory=DrafterInputsConfig)
    random: Optional[RandomTargetConfig] = None

    def __post_init__(self) -> None:
        _check(self.source in (MISSING, *TARGET_SOURCES), "target.source", f"{self.source!r} is not one of {TARGET_SOURCES}")


def default_tap_ids(num_layers: int, n_taps: int) -> list[int]:
    """The reference DFlash tap rule (z-lab/dflash `model/utils.py: build_target_layer_ids`, which
    SGLang's and SpecForge's DFlash code mirror): one tap → [L // 2]; otherwise
    round(1 + i * (L - 4) / (n - 1)) for i < n with Python's round (half to even), so published
    drafter configs and ours agree: 36 layers, 5 taps → [1, 9, 17, 25, 33]; 30 → [1, 8, 14, 20, 27]."""
    if n_taps < 1:
        raise ValueError("n_taps must be >= 1")
    if n_taps == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    if end < start:
        raise ValueError(f"target has {num_layers} layers: too few to tap (need >= 4)")
    span = end - start
    ids = [int(round(start + i * span / (n_taps - 1))) for i in range(n_taps)]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{n_taps} distinct taps do not fit in layers [1, {end}]: set target.drafter.target_layer_ids")
    return ids
