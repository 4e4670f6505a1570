"""The target's frozen embedding table and LM head, read alone from its safetensors.

Only these two tensors are loaded (never the whole target). A tied target (no lm_head.weight)
uses the embedding table for both.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from draftforge.drafter.warm_start import read_tensors
from draftforge.errors import StageError

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
HEAD_NAMES = ("lm_head.weight",)


class FrozenTargetHead(nn.Module):
    """embed (V, H) and lm_head (V, H) as buffers: not trained, not in the drafter's state."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...,) int64 → (..., H)."""
        return self.embed[ids]

    @classmethod
    def from_target(cls, hf_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "FrozenTargetHead":
        found = read_tensors(hf_dir, list(EMBED_NAMES + HEAD_NAMES))
        embed = next((found[n] for n in EMBED_NAMES if n in found), None)
        if embed is None:
            raise StageError(f"{hf_dir}: no embedding table ({' / '.join(EMBED_NAMES)}) in the target's safetensors")
        head = found.get("lm_head.weight", embed)
        if head.shape != embed.shape:
            raise StageError(f"{hf_dir}: lm_head {tuple(head.shape)} and embeddings {tuple(embed.shape)} differ in shape")
        return cls(embed.to(device=device, dtype=dtype), head.to(device=device, dtype=dtype))
