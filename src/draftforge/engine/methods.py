"""Speculative methods: what a round drafts and which tree it asks the target to verify.

A method is the drafting half of a round; the loop (`loops.py`) owns the target half (verify the tree in
one forward, walk it with the target's own samples, commit the accepted root path). Every method
builds a `Tree` rooted at the bonus token: a chain method builds a one-path tree, so chains and trees
share one verification rule and one losslessness argument (every committed token is the target's own
sample given the exact committed prefix). Lifecycle per generation:

    begin(prompt features) → draft(bonus, start) → build(drafted, bonus) → verify → observe(path features) → …

New methods (MTP heads, Markov-conditioned trees, …) implement `Method` and register in `METHODS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from draftforge.engine.target import TargetModel, embed_tokens
from draftforge.engine.tree import Tree, build_tree, chain_tree, draft_topk


@dataclass
class Features:
    """Target outputs for committed tokens, the context a drafter conditions on."""

    taps: torch.Tensor | None  # (1, n, n_taps*H) tapped layer outputs, tap order
    hidden: torch.Tensor  # (1, n, H) final-normed last-layer states
    ids: torch.Tensor | None = None  # (1, n) the committed tokens these rows belong to


class Method(Protocol):
    name: str
    budget: int | None  # tree budget (None for chain methods)
    verify_size: int  # most tokens one verify span holds, root included (capacity, capture buckets)
    needs_taps: bool

    def begin(self, feats: Features) -> None: ...
    def draft(self, bonus: int, start: int) -> Any: ...
    def build(self, drafted: Any, bonus: int) -> Tree: ...
    def observe(self, feats: Features) -> None: ...


class DrafterContext:
    """A block drafter's context KV cache plus the features of committed tokens not yet in it."""

    def __init__(self, drafter: Any, tm: TargetModel) -> None:
        if tuple(drafter.cfg.target_layer_ids) != tm.tap_ids:
            raise ValueError(f"drafter taps {drafter.cfg.target_layer_ids} != target wrapper taps {list(tm.tap_ids)}")
        self.drafter, self.tm = drafter, tm
        self.cache = drafter.new_cache()
        self.pending: torch.Tensor | None = None  # (1, n_new, n_taps*H) positions cache.length..start-1
        self.block = drafter.cfg.block_size
        self.mask_id = drafter.cfg.mask_token_id
        # The first predicting slot: 1 for DFlash's fill-in block (slot 0 is the bonus), 0 for DSpark's
        # default block (every slot predicts the next position).
        self.first_slot = getattr(drafter.cfg, "first_slot", 1)
        self.n_draft = self.block - self.first_slot

    def add(self, taps: torch.Tensor | None) -> None:
        if taps is None or not taps.shape[1]:
            return
        self.pending = taps if self.pending is None else torch.cat([self.pending, taps], dim=1)

    def block_hidden(self, bonus: int, start: int) -> torch.Tensor:
        """One drafter pass over [bonus, mask × (B−1)] at positions start.. → block states (1, B, H)."""
        d = self.drafter
        ctx_new = d.project_context(self.pending) if self.pending is not None else None
        emb = embed_tokens(self.tm, [bonus] + [self.mask_id] * (self.block - 1)).to(d.fc.weight.dtype)
        h = d.draft(emb, start, ctx_new, self.cache)  # (1, B, H)
        self.cache.crop(start)  # context only: committed positions 0..start-1
        self.pending = None
        return h

    def block_logits(self, bonus: int, start: int) -> torch.Tensor:
        """(n_draft, V) logits of the predicting slots (depths 1..n_draft; DFlash: the B−1 masked slots)."""
        h = self.block_hidden(bonus, start)
        return self.tm.lm_head(h[0, self.first_slot :].to(self.tm.dtype))


class DFlashChain:
    """DFlash: the per-slot argmax of one block pass, verified as a chain."""

    name, budget, needs_taps = "dflash", None, True

    def __init__(self, tm: TargetModel, drafter: Any, budget: int | None = None) -> None:
        self.ctx = DrafterContext(drafter, tm)
        self.verify_size = 1 + self.ctx.n_draft

    def begin(self, feats: Features) -> None:
        self.ctx.add(feats.taps)

    def draft(self, bonus: int, start: int) -> torch.Tensor:
        return self.ctx.block_logits(bonus, start)

    def build(self, drafted: torch.Tensor, bonus: int) -> Tree:
        return chain_tree(bonus, drafted.argmax(dim=-1).tolist())  # argmax at any temperature

    def observe(self, feats: Features) -> None:
        self.ctx.add(feats.taps)


def tree_budget(method: str, budget: int | None) -> int:
    """A tree method's node budget (>= 1); it verifies 1 + budget rows (the bonus is the root)."""
    if budget is None or budget < 1:
        raise ValueError(f"{method} budget {budget} < 1")
    return int(budget)


class DDTree(DFlashChain):
    """DDTree: the best-first tree of `budget` nodes over the block's per-depth top-K log-probs."""

    name = "ddtree"

    def __init__(self, tm: TargetModel, drafter: Any, budget: int | None = None) -> None:
        self.budget = tree_budget(self.name, budget)
        super().__init__(tm, drafter)
        self.verify_size = 1 + self.budget

    def build(self, drafted: torch.Tensor, bonus: int) -> Tree:
        logp, toks = draft_topk(drafted, min(self.budget, drafted.shape[-1]))
        return build_tree(bonus, logp, toks, self.budget)


from draftforge.engine.mtp import MTPChain  # noqa: E402

METHODS: dict[str, Callable[..., Method]] = {"dflash": DFlashChain, "ddtree": DDTree, "mtp": MTPChain}


def make_method(name: str, tm: TargetModel, drafter: Any = None, budget: int | None = None) -> Method | None:
    """A method by name (None for "ar": the loop's plain one-token rounds)."""
    if name == "ar":
        return None
    if name not in METHODS:
        raise ValueError(f"engine: unknown method {name!r}; known: ['ar', {', '.join(repr(m) for m in METHODS)}]")
    if drafter is None:
        raise ValueError(f"engine: method {name!r} needs a drafter")
    return METHODS[name](tm, drafter, budget)
