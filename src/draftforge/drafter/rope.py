"""The HF rotary module called one way for the target's layers (engine/target.py) and the MTP head's layer
(drafter/mtp.py): Qwen3.5-family text models use multimodal rope, whose positions are (3, S, n) with three
equal rows for text; older transformers do not expand an (S, n) input themselves (transformers 5.17 raises
an IndexError), so the expansion is done here for every version."""

from __future__ import annotations

import torch
from torch import nn


def rotary_tables(rotary: nn.Module, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (S, n) → cos, sin (S, n, rot) in the rotary module's output dtype."""
    if hasattr(rotary, "mrope_section"):  # (3, S, n): text positions repeat on the three rope axes
        positions = positions[None].expand(3, *positions.shape)
    return rotary(like, positions)
