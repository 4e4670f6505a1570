"""`target.json`, the record every downstream stage reads (torch-free): typed keys, written by the
`target` stage, read through `draftforge.target.load.read_target_info` (which checks the required keys)."""

from __future__ import annotations

from typing import List, Optional, TypedDict


class DrafterInputs(TypedDict, total=False):
    """What the target fixes for every drafter (resolved): taps are 0-based "output of decoder layer i"."""

    mask_token_id: int  # a row of the target's embedding table, never emitted in chat
    target_layer_ids: List[int]
    n_taps: int


class TargetInfo(TypedDict, total=False):
    name: str
    source: str
    hf_path: str  # absolute HF folder
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    weights_dtype: str
    eos_token_ids: List[int]
    pad_token_id: Optional[int]
    mtp_layers: int
    hybrid_attention: bool
    chat_template: bool
    dtype: str  # compute dtype on GPU
    fingerprint: str  # sha256 of config.json + weight names and shapes
    drafter: DrafterInputs


# The keys a reader needs before it trusts the record.
REQUIRED_KEYS: tuple[str, ...] = (
    "name", "hf_path", "architecture", "num_layers", "hidden_size", "num_heads", "num_kv_heads",
    "head_dim", "vocab_size", "fingerprint", "drafter",
)  # fmt: skip
