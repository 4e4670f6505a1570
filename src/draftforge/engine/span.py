"""A span: the tokens one target forward appends after the committed prefix, and their visibility.

Every forward is a span: a prompt prefill and an AR step are chains committed whole, a DFlash verify is
a chain of which a prefix is kept, a DDTree verify is a tree of which a root path is kept. Attention
layers read `mask`; GDN layers read `depths`, `anc` and `anc_at` (the same visibility, as indices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftforge.engine.gdn import ancestors_at
from draftforge.engine.tree import Tree, ancestor_matrix


@dataclass
class Span:
    ids: torch.Tensor  # (1, n) int64
    positions: torch.Tensor  # (n,) rotary position of each token
    depths: torch.Tensor  # (n,) distance from the span's root (a chain: 0..n-1)
    mask: torch.Tensor | None  # additive (1, 1, n, past + n); None = one token, or causal from row 0
    anc: torch.Tensor | None = None  # (n, n) bool ancestor-or-self; None = causal chain
    anc_at: torch.Tensor | None = None  # (n, K) o-th ancestor (−1 past the root); None = chain
    commit_all: bool = False  # prefill/AR: every token is kept, states may advance in place

    @property
    def n(self) -> int:
        return self.ids.shape[1]


def causal_mask(past: int, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive (1, 1, n, past+n): query j sees rows < past + j + 1. None for n == 1 (sees all) and for a
    chain from row 0 (a prefill: the attention runs SDPA's causal rule, no n × n mask is built)."""
    if n == 1 or past == 0:
        return None
    cols = torch.arange(past + n, device=device)
    rows = torch.arange(n, device=device)[:, None] + past
    return torch.zeros((), device=device, dtype=dtype).masked_fill(cols[None, :] > rows, float("-inf"))[None, None]


def chain_span(ids: torch.Tensor, past: int, dtype: torch.dtype, commit_all: bool) -> Span:
    """ids (1, n) at positions past..past+n−1, each seeing the past and the chain before it."""
    n = ids.shape[1]
    steps = torch.arange(n, device=ids.device)
    return Span(ids, past + steps, steps, causal_mask(past, n, ids.device, dtype), commit_all=commit_all)


def tree_span(tree: Tree, start: int, device: torch.device, dtype: torch.dtype, conv_kernel: int = 0) -> Span:
    """The flattened tree at positions start + depth; each node sees the past, its ancestors and itself."""
    n = len(tree)
    meta = torch.tensor([tree.tokens, tree.parents, tree.depths], dtype=torch.long)  # (3, n) host
    anc = ancestor_matrix(meta[1].clamp(min=0), meta[2], max(tree.depths))  # (n, n) host: no per-level launches
    anc_at = ancestors_at(meta[1], conv_kernel).to(device) if conv_kernel else None
    if device.type == "cuda":
        anc = anc.pin_memory()
    anc_d = anc.to(device, non_blocking=True)
    ids = meta[0].to(device, non_blocking=True)
    depths = meta[2].to(device, non_blocking=True)
    mask = torch.zeros(n, start + n, device=device, dtype=dtype)
    mask[:, start:].masked_fill_(~anc_d, float("-inf"))
    return Span(ids[None], start + depths, depths, mask[None, None], anc=anc_d, anc_at=anc_at)
