"""The one sampling rule every loop uses (docs/architecture.md, "Engine"): argmax at T≈0, else one multinomial draw."""

from __future__ import annotations

import torch

GREEDY_EPS = 1e-5


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_EPS


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (n, V) → (n,) int64: argmax when T≈0, else a draw from softmax(logits / T) per row."""
    if is_greedy(temperature):
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
