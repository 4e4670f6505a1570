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

from draftforge.engine.draft import DrafterContext
from draftforge.engine.target import TargetModel
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


class BlockMethod:
    """A method that drafts with a block drafter's pass (`draft.DrafterContext`): DFlash, DDTree, DSpark.

    A captured engine gives the method its static context for the generation (`attach`); the drafter, its
    first predicting slot and its drafts per block are the context's, so both engines draft the same."""

    needs_taps = True

    def __init__(self, tm: TargetModel, drafter: Any) -> None:
        self.tm, self.drafter = tm, drafter
        self.ctx = DrafterContext(drafter, tm)
        self.n_draft = self.ctx.n_draft

    def attach(self, ctx: DrafterContext) -> None:
        if ctx.drafter is not self.drafter:
            raise ValueError("engine: the captured engine was built for another drafter than this method's")
        self.ctx = ctx

    def begin(self, feats: Features) -> None:
        self.ctx.reset()
        self.ctx.add(feats.taps)

    def observe(self, feats: Features) -> None:
        self.ctx.add(feats.taps)


class DFlashChain(BlockMethod):
    """DFlash: the per-slot argmax of one block pass, verified as a chain."""

    name, budget = "dflash", None

    def __init__(self, tm: TargetModel, drafter: Any, budget: int | None = None) -> None:
        super().__init__(tm, drafter)
        self.verify_size = 1 + self.n_draft

    def draft(self, bonus: int, start: int) -> torch.Tensor:
        return self.ctx.block_logits(bonus, start)

    def build(self, drafted: torch.Tensor, bonus: int) -> Tree:
        return chain_tree(bonus, drafted.argmax(dim=-1).tolist())  # argmax at any temperature


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

    def draft(self, bonus: int, start: int) -> torch.Tensor:
        return self.ctx.block_logits(bonus, start, depths=self.budget)  # a tree of `budget` nodes is no deeper

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
