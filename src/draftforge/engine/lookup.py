"""DDTree with a prompt-lookup branch (`ddtree_lookup`): the drafter's tree plus the text that followed the last
few tokens where they occurred before (docs/architecture.md, "Prompt lookup in the tree").

Answers copy from their context: code repeats its prompt's names, arithmetic its numbers, a rewrite its first
draft. Each round looks up the longest suffix of the committed tokens + the bonus (`n_max` … `n_min` tokens) at
its most recent earlier occurrence in the same context and proposes the tokens that followed it, up to the
budget. `tree.graft_chain` adds that path to the DDTree tree and keeps the `budget` best nodes, so the verify
size, the round's cost and the calibrated budget are DDTree's; without a match the tree is DDTree's.

A lookup token's score is log q per depth, q its acceptance so far in this generation: (accepted + 1) ÷
(offered + 2), counting a depth as offered only once the depth before it was accepted. The tree is verified and
walked like any other, so decoding stays lossless at every temperature.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from draftforge.engine.methods import METHODS, DDTree, Features
from draftforge.engine.tree import Tree, graft_chain

N_MIN, N_MAX = 2, 4  # n-gram lengths looked up, longest first (vLLM's prompt-lookup defaults for ngram)


class NgramIndex:
    """A token sequence that grows at its end, and where each of its n-grams last occurred before the end."""

    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"prompt lookup: n-gram lengths {n_min}..{n_max} need 1 <= n_min <= n_max")
        self.n_min, self.n_max = n_min, n_max
        self.ids: list[int] = []
        # n-gram → the position right after its latest occurrence; holds every n-gram ending before the last token
        self.last: dict[tuple[int, ...], int] = {}

    def reset(self, ids: Sequence[int]) -> None:
        self.ids, self.last = [], {}
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        # the n-grams ending at the old last position and the new ones but the last: the suffix itself must find an
        # earlier occurrence, so an n-gram is indexed once a token follows it
        first = max(len(self.ids), 1)
        self.ids.extend(int(t) for t in ids)
        for end in range(first, len(self.ids)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.last[tuple(self.ids[end - n : end])] = end

    def continuation(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to k tokens that followed the longest matching suffix of ids + `after` (not yet committed)."""
        after = [int(t) for t in after]
        tail = (self.ids[-self.n_max :] + after)[-self.n_max :]  # the suffixes looked up (not the whole sequence)
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            pos = self.last.get(tuple(tail[len(tail) - n :]))
            if pos is not None:  # pos < len(ids): what followed runs on into `after` at most
                return (self.ids[pos : pos + k] + after)[:k]
        return []


class DDTreeLookup(DDTree):
    """DDTree whose tree also holds the prompt-lookup continuation of the bonus (see the module docstring)."""

    name = "ddtree_lookup"

    def __init__(self, tm: Any, drafter: Any, budget: int | None = None) -> None:
        super().__init__(tm, drafter, budget)
        self.index = NgramIndex()
        self.offered: list[int] = []  # the lookup tokens the last tree verifies, in chain order
        self.accepted = self.tried = 0

    def begin(self, feats: Features) -> None:
        super().begin(feats)
        self.index.reset([] if feats.ids is None else feats.ids[0].tolist())
        self.offered, self.accepted, self.tried = [], 0, 0

    def observe(self, feats: Features) -> None:
        super().observe(feats)
        path = feats.ids[0].tolist()  # the old bonus, then the accepted drafts
        for i, tok in enumerate(self.offered):  # depth i + 1 was offered with every depth before it accepted
            self.tried += 1
            if i + 1 >= len(path) or path[i + 1] != tok:
                break
            self.accepted += 1
        self.index.extend(path)

    def build(self, drafted: Any, bonus: int) -> Tree:
        tree = super().build(drafted, bonus)  # DDTree's own tree of `budget` nodes
        chain = self.index.continuation(self.budget, after=[bonus])
        if not chain:
            self.offered = []
            return tree
        q = (self.accepted + 1) / (self.tried + 2)
        tree = graft_chain(tree, chain, math.log(q), self.budget)
        kept = tree.children()
        self.offered, node = [], 0
        for tok in chain:  # the chain's prefix the tree kept: what this round offers
            node = kept.get((node, tok))
            if node is None:
                break
            self.offered.append(tok)
        return tree


METHODS["ddtree_lookup"] = DDTreeLookup
