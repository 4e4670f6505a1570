"""DDTree with a prompt-lookup branch (`ddtree_lookup`): the drafter's tree plus the text that followed the last
few tokens where they occurred before (docs/architecture.md, "Prompt lookup in the tree").

Answers copy from their context: code repeats its prompt's names, arithmetic its numbers, a rewrite its first
draft. Each round looks up the longest suffix of the committed tokens + the bonus (`n_max` … `n_min` tokens) at
its most recent earlier occurrence in the same context and proposes the tokens that followed it. `tree.graft_chain`
adds that path to DDTree's tree of `budget` nodes: the budget buys the drafter's nodes, the lookup's come on top.

The lookup offers its path as deep as it pays: depth i while q^i >= `MIN_PATH_ACCEPT`, at most `LOOKUP_DEPTH`,
where q is a lookup token's acceptance so far in this generation, (accepted + 1) ÷ (tried + 2). A proposed depth
counts as tried once the depth before it was accepted and the target's token there is known (offered or not), so q
keeps learning while little is offered. A round verifies 1 + budget nodes without a match, at most 1 + budget +
LOOKUP_DEPTH with one. The tree is verified and walked like any other, so decoding stays lossless
at every temperature.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from draftforge.engine.methods import METHODS, DDTree, Features
from draftforge.engine.tree import Tree, graft_chain

N_MIN, N_MAX = 2, 4  # n-gram lengths looked up, longest first (vLLM's prompt-lookup defaults for ngram)
LOOKUP_DEPTH = 8  # the most lookup tokens one round offers beyond the budget
# A lookup token at depth i is offered while q^i, its chance to be accepted, is at least this. On the 2-core CPU a
# verify node costs ~2 ms of a ~55 ms round that commits ~1.9 tokens, so a node pays above ~0.07 (docs/benchmarks.md,
# "Prompt-lookup tokens beyond the budget").
MIN_PATH_ACCEPT = 0.1


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
        self.verify_size = 1 + self.budget + LOOKUP_DEPTH
        self.index = NgramIndex()
        self.proposed: list[int] = []  # this round's lookup path, LOOKUP_DEPTH deep at most
        self.offered = 0  # how much of it the tree holds
        self.accepted = self.tried = 0

    def begin(self, feats: Features) -> None:
        super().begin(feats)
        self.index.reset([] if feats.ids is None else feats.ids[0].tolist())
        self.proposed, self.offered, self.accepted, self.tried = [], 0, 0, 0

    def observe(self, feats: Features) -> None:
        super().observe(feats)
        path = feats.ids[0].tolist()  # the old bonus, then the accepted drafts: the target's tokens at depths < len
        # Depth d of the proposed path counts as tried once every depth before it was accepted, and only where the
        # target's token there is known: d < len(path), or d == len(path) if the tree held it (then rejected). So
        # q also learns from the rounds that offered less than the lookup proposed.
        for depth, tok in enumerate(self.proposed, start=1):
            if depth > len(path) or (depth == len(path) and depth > self.offered):
                break
            self.tried += 1
            if depth == len(path) or path[depth] != tok:
                break
            self.accepted += 1
        self.index.extend(path)

    def accept_rate(self) -> float:
        """q: a lookup token's acceptance so far in this generation, in (0, 1)."""
        return (self.accepted + 1) / (self.tried + 2)

    def lookup_depth(self) -> int:
        """How deep this round's lookup path goes: the largest i <= LOOKUP_DEPTH with q^i >= MIN_PATH_ACCEPT."""
        return min(LOOKUP_DEPTH, int(math.log(MIN_PATH_ACCEPT) / math.log(self.accept_rate()) + 1e-9))

    def build(self, drafted: Any, bonus: int) -> Tree:
        tree = super().build(drafted, bonus)  # DDTree's own tree of `budget` nodes
        self.proposed = self.index.continuation(LOOKUP_DEPTH, after=[bonus])
        self.offered = min(self.lookup_depth(), len(self.proposed))
        if not self.offered:
            return tree
        return graft_chain(tree, self.proposed[: self.offered], math.log(self.accept_rate()))


METHODS["ddtree_lookup"] = DDTreeLookup
