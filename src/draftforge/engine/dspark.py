"""DSpark methods: the Markov-biased chain (`dspark`) and the Markov-conditioned DDTree (`ddtree_markov`).

Both run the drafter's backbone once per round (the DFlash block pass, `draft.DrafterContext.block_logits`) and
read the base logits of its predicting slots, z_d (depth d = 1..D; D = B drafts with DSpark's default
block, B-1 with the DFlash fill-in block). The Markov head turns them into the conditional draft
distribution of depth d given the token x at depth d-1 (the bonus for d = 1):
    q_d(· | x) = softmax(z_d + markov_w2 · markov_w1[x])                  (vLLM's DSpark speculator)

`dspark`: left to right, x_d = argmax q_d(· | x_{d-1}) — at every temperature (like `dflash`; the
verification samples from the target, so drafting greedily at T > 0 stays lossless and only changes τ).

`ddtree_markov` (budget b): DDTree's best-first search over prefixes scored by summed log-probabilities,
but a node's children are ranked by q_{d+1}(· | the node's own token) instead of the depth's marginal:
siblings of the spine get their own continuation distributions. Normalisation: the full-vocabulary
fp32 log-softmax of z_d + bias (temperature 1), then the top K = min(b, V) of it. Why full-vocabulary
and not a softmax restricted to the base top-K (vLLM's `dspark_draft_topk`): the score of a path is then
the drafter's own log-probability of that path, comparable across branches whose Markov biases differ;
a restricted softmax renormalises each node's children over a set chosen without the bias and so
overstates a child's probability exactly where the bias moves mass elsewhere (the case the Markov head
exists for), and a path through such a node would be over-ranked. Children depend only on
(depth, parent token) (a first-order head), so each distinct pair costs one r × V product per round.
Log-probs are ≤ 0 and children lists are sorted, so popping in score order still yields the b
best prefixes, topologically ordered.
"""

from __future__ import annotations

from typing import Any

import torch

from draftforge.engine.methods import METHODS, BlockMethod, tree_budget
from draftforge.engine.target import TargetModel
from draftforge.engine.tree import Tree, chain_tree


def require_dspark(drafter: Any, method: str) -> None:
    from draftforge.drafter.types.dspark import is_dspark

    if not is_dspark(getattr(drafter, "cfg", None)):
        raise ValueError(f"engine: method {method!r} needs a DSpark drafter (Markov head); this drafter is DFlash: "
                         f"run 'dflash' / 'ddtree' with it")


class _MarkovBase(BlockMethod):
    def __init__(self, tm: TargetModel, drafter: Any) -> None:
        require_dspark(drafter, self.name)
        super().__init__(tm, drafter)
        head = drafter.markov_head
        self.w1 = head.markov_w1.weight.detach().float() if head is not None else None  # (V, r)
        self.w2 = head.markov_w2.weight.detach().float() if head is not None else None  # (V, r)
        self.w2_norm = self.w2.norm(dim=1) if head is not None else None  # (V,) ‖W2_v‖ bounds |bias_v| / ‖e‖

    def base_logits(self, bonus: int, start: int) -> torch.Tensor:
        """(D, V) fp32 base logits of the predicting slots (depths 1..D)."""
        return self.ctx.block_logits(bonus, start).float()

    def bias(self, prev: torch.Tensor) -> torch.Tensor | int:
        """prev (...,) int64 → (..., V) Markov bias (0 without a head)."""
        return 0 if self.w1 is None else self.w1[prev] @ self.w2.t()


class DSparkChain(_MarkovBase):
    """DSpark: one backbone pass, then the drafts left to right with the Markov bias (greedy)."""

    name, budget = "dspark", None

    def __init__(self, tm: TargetModel, drafter: Any, budget: int | None = None) -> None:
        super().__init__(tm, drafter)
        self.verify_size = 1 + self.n_draft

    def draft(self, bonus: int, start: int) -> torch.Tensor:
        base = self.base_logits(bonus, start)
        if self.w1 is None:
            return base.argmax(-1)
        prev, toks = bonus, []
        for d in range(base.shape[0]):  # sequential: each draft conditions the next
            prev = markov_argmax(base[d], self.w1[prev], self.w2, self.w2_norm)
            toks.append(prev)
        return torch.tensor(toks)

    def build(self, drafted: torch.Tensor, bonus: int) -> Tree:
        return chain_tree(bonus, drafted.tolist())


class DDTreeMarkov(_MarkovBase):
    """DDTree whose children are ranked by the Markov-conditioned distribution given their parent's token."""

    name = "ddtree_markov"

    def __init__(self, tm: TargetModel, drafter: Any, budget: int | None = None) -> None:
        self.budget = tree_budget(self.name, budget)
        super().__init__(tm, drafter)
        self.verify_size = 1 + self.budget

    def draft(self, bonus: int, start: int) -> torch.Tensor:
        return self.base_logits(bonus, start)

    def build(self, drafted: torch.Tensor, bonus: int) -> Tree:
        return build_markov_tree(bonus, drafted, self.bias, self.budget)


def markov_argmax(z: torch.Tensor, e: torch.Tensor, w2: torch.Tensor, w2_norm: torch.Tensor, k: int = 32) -> int:
    """argmax_v z_v + w2_v · e over the vocabulary without the whole (V, r) product.

    |w2_v · e| ≤ ‖w2_v‖ ‖e‖, so ub_v = z_v + ‖w2_v‖ ‖e‖ bounds every score. The exact scores of the top-k
    tokens by ub give a best b; every token outside them has ub ≤ the k-th ub, so once that is < b the
    answer is exact (ties broken towards the lower id, as argmax does); otherwise k grows. Reads the (V,)
    vectors and k rows of w2 instead of all V rows: one r × V product (the head's whole W2) per draft was
    the DSpark chain's cost on a CPU (docs/benchmarks.md)."""
    V = z.shape[0]
    ub = z + w2_norm * e.norm()
    while True:
        k = min(k, V)
        top_ub, cand = torch.topk(ub, k)
        exact = z[cand] + w2[cand] @ e  # (k,)
        best = exact.max()
        if k == V or top_ub[-1] < best:
            winners = cand[exact == best]
            return int(winners.min())
        k *= 4


def build_markov_tree(bonus: int, base: torch.Tensor, bias, budget: int) -> Tree:
    """The `budget` best prefixes, where a node at depth d with token x has children ranked by
    log_softmax(base[d] + bias(x)) (fp32, full vocabulary), top K = min(budget, V) of them.

    Built a depth at a time: the best `budget` prefixes are prefix-closed (log-probs ≤ 0, so a child never
    outscores its parent), hence each depth's members are among the top K children of the previous depth's
    members, and one batched (n, r) × (r, V) product, log-softmax and top-K per depth replaces one per node.
    A candidate below the budget-th best score found so far can neither enter nor have a descendant enter,
    so it is dropped before its depth is expanded. Nodes are ordered by score, the shallower first on a tie:
    parents precede children (the verify input is topologically ordered)."""
    depth_max, V = base.shape
    k = min(budget, V)
    tree = Tree(tokens=[bonus], parents=[-1], depths=[0], scores=[0.0])
    if budget <= 0 or depth_max == 0:
        return tree
    dev = base.device
    toks, scores = torch.tensor([bonus], device=dev), torch.zeros(1, device=dev)  # (n,) the frontier: tokens, path scores
    parents = torch.tensor([-1], device=dev)  # (n,) the frontier's index in `found` (-1: the root)
    found: list[tuple[torch.Tensor, ...]] = []  # per depth: (scores, tokens, parent ids, depth)
    best = torch.empty(0, device=dev)  # (≤ budget,) the best scores found so far
    offset = 0
    for d in range(depth_max):
        logits = base[d].float().expand(len(toks), V) + bias(toks)  # (n, V)
        vals, idx = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)  # (n, k) sorted
        cand = (scores[:, None] + vals).flatten()  # (n·k,)
        best = torch.topk(torch.cat([best, cand]), min(budget, len(best) + len(cand))).values
        keep = cand >= best[-1] if len(best) == budget else torch.ones_like(cand, dtype=torch.bool)
        if not bool(keep.any()):
            break
        rows = torch.arange(len(toks), device=dev).repeat_interleave(k)[keep]  # (m,) the parent of each kept candidate
        toks, scores = idx.flatten()[keep], cand[keep]
        found.append((scores, toks, parents[rows], torch.full((len(toks),), d + 1, device=dev)))
        parents = torch.arange(offset, offset + len(toks), device=dev)
        offset += len(toks)
    all_scores, all_toks, all_parents, all_depths = (torch.cat(x).tolist() for x in zip(*found))
    order = sorted(range(len(all_scores)), key=lambda i: (-all_scores[i], all_depths[i]))[:budget]
    index = {i: n + 1 for n, i in enumerate(order)}  # candidate id → tree index (root is 0)
    for i in order:
        p = all_parents[i]
        tree.tokens.append(all_toks[i])
        tree.parents.append(0 if p < 0 else index[p])
        tree.depths.append(all_depths[i])
        tree.scores.append(all_scores[i])
    return tree


METHODS.update({"dspark": DSparkChain, "ddtree_markov": DDTreeMarkov})
