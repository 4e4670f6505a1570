"""The draft vocabulary (docs/architecture.md, "Draft vocabulary"): the D target tokens a drafter drafts from.

Invariants: the ids are ascending and distinct, chosen by train as the D most frequent supervised tokens of the
train split (ties: the lower id); a drafter with a draft vocabulary scores exactly those D rows of the target's
LM head, so every other token gets probability 0 in its drafts (logit −inf once mapped to the target's vocabulary).
Verification never changes: the target accepts or rejects drafted tokens as it always does, so decoding stays
lossless; only tokens outside the D are never drafted.
"""

from __future__ import annotations

import torch


def choose_draft_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """counts (V,) occurrences of each target token among the labels → (size,) int64 ascending ids of the most
    frequent (ties: the lower id)."""
    if not 0 < size < counts.shape[0]:
        raise ValueError(f"draft vocabulary of {size} tokens: need 0 < size < vocabulary {counts.shape[0]}")
    order = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices  # stable: lower id first on ties
    return order[:size].sort().values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """The share of the counted labels whose token is in the draft vocabulary (1.0 without labels)."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 1.0


def target_to_draft(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) int64: the draft row of each target token, −1 for a token outside the draft vocabulary."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    t2d[ids] = torch.arange(ids.shape[0], device=ids.device)
    return t2d


def to_target_logits(draft_logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., D) logits over the draft vocabulary → (..., V) over the target's, −inf outside it."""
    out = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    out[..., ids] = draft_logits
    return out
