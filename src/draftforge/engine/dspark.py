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

With a draft vocabulary of D tokens (docs/architecture.md, "Draft vocabulary") both methods work over the D
drafted rows: z_d and the bias are D columns (markov_w2 has D rows), the normaliser is over the D (the drafter
gives every other token probability 0), and a column is mapped to its target id before it becomes a draft or a
node's token (markov_w1 is indexed by target ids). Each bias product then reads D × r of W2 instead of V × r.
"""

from __future__ import annotations

from typing import Any

import torch

from draftforge.engine import cpu_linear
from draftforge.engine.methods import METHODS, BlockMethod, tree_budget
from draftforge.engine.target import TargetModel
from draftforge.engine.tree import Tree, best_nodes, chain_tree


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
        self.w2 = head.markov_w2.weight.detach().float() if head is not None else None  # (V', r)
        self.w2_norm = self.w2.norm(dim=1) if head is not None else None  # (V',) ‖W2_v‖ bounds |bias_v| / ‖e‖
        if self.w2 is not None:
            cpu_linear.register(self.w2)  # CPU: the bias product on its measured route (engine/cpu_linear.py)
        self.ids = self.ctx.draft_ids  # (D,) target id of each drafted column, None: the whole vocabulary (V' = V)

    def base_logits(self, bonus: int, start: int) -> torch.Tensor:
        """(depths, V') fp32 base logits of the predicting slots (depths 1..n_draft) over the drafted columns."""
        logits = self.ctx.block_logits(bonus, start).float()  # (depths, V): −inf outside a draft vocabulary
        return logits if self.ids is None else logits[:, self.ids]

    def token(self, column: int) -> int:
        """The target id of a drafted column."""
        return column if self.ids is None else int(self.ids[column])

    def bias(self, prev: torch.Tensor) -> torch.Tensor | int:
        """prev (m,) int64 target ids → (m, V') Markov bias e · W2ᵀ, e = W1[prev] (0 without a head): one read of
        the (V', r) W2 for the m rows, on the CPU by the route measured for (W2's shape, m) (the engine's kernel
        where built)."""
        return 0 if self.w1 is None else cpu_linear.linear(self.w1[prev], self.w2)


class DSparkChain(_MarkovBase):
    """DSpark: one backbone pass, then the drafts left to right with the Markov bias (greedy)."""

    name, budget = "dspark", None

    def __init__(self, tm: TargetModel, drafter: Any, budget: int | None = None) -> None:
        super().__init__(tm, drafter)
        self.verify_size = 1 + self.n_draft

    def draft(self, bonus: int, start: int) -> torch.Tensor:
        base = self.base_logits(bonus, start)
        if self.w1 is None:
            columns = base.argmax(-1)
            return columns if self.ids is None else self.ids[columns]
        prev, toks = bonus, []
        for d in range(base.shape[0]):  # sequential: each draft conditions the next
            prev = self.token(markov_argmax(base[d], self.w1[prev], self.w2, self.w2_norm))
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
        return build_markov_tree(bonus, drafted, self.bias, self.budget, ids=self.ids)


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


def markov_batch(budget: int) -> int:
    """Frontier nodes `build_markov_tree` expands per round at this budget: 4 up to 8, else 8. A round reads the
    head's whole W2 once whatever its rows, so a larger tree pays for fewer, wider rounds, but each row also pays a
    log-softmax and top-K over V and a wide round wastes up to batch − 1 expansions. Measured on the 2-core CPU
    (docs/benchmarks.md, "The kernel prefetches at every row count; ddtree_markov's bias on the kernel"): at budget 64, 8 was the fastest or tied on both a peaked and
    a flat drafter, 16 lost on the flat one. The tree does not depend on it."""
    return 4 if budget <= 8 else 8


def build_markov_tree(bonus: int, base: torch.Tensor, bias, budget: int, batch: int | None = None,
                      ids: torch.Tensor | None = None) -> Tree:
    """The `budget` best prefixes, where a node at depth d with token x has children ranked by
    log_softmax(base[d] + bias(x)) (fp32, over all of base's V' columns), top K = min(budget, V') of them.
    ids (V',): the target id of each column (a draft vocabulary; None: column = id). Node tokens, and so bias's
    argument, are target ids.

    Best-first with lazy expansion: a node's children (one r × V bias row, log-softmax and top-K over V) are
    computed only once the node is accepted, `batch` frontier nodes at a time (default `markov_batch(budget)`; one
    (m, r) × (r, V) product per round). While fewer than `budget` nodes are accepted, the best `batch` of the frontier are accepted; after
    that, a frontier node that beats the budget-th accepted one is (it enters, pushing the last one out). It
    ends when no frontier node beats it: every accepted node is expanded and the budget-th best prefix cannot
    improve, so the `budget` best accepted are the `budget` best prefixes (a child never outscores its parent:
    log-probs ≤ 0; and a best prefix is among its parent's top K children). Accepting one node a round expands
    exactly `budget` nodes; a batch wastes at most batch − 1 expansions a round and cuts the rounds, and with
    them the reads of the head's (V, r) W2. Expanding every depth's surviving candidates instead (the earlier
    form) expanded ~5× the budget on a peaked drafter (docs/benchmarks.md). Nodes are ordered by score, the
    shallower first on a tie: parents precede children (the verify input is topologically ordered)."""
    depth_max, V = base.shape
    k = min(budget, V)
    batch = markov_batch(budget) if batch is None else batch
    tree = Tree(tokens=[bonus], parents=[-1], depths=[0], scores=[0.0])
    if budget <= 0 or depth_max == 0:
        return tree
    dev = base.device
    # every node found so far (id 0 = the root): token, path score, parent id, depth
    toks, scores = torch.tensor([bonus], device=dev), torch.zeros(1, device=dev)
    parents, depths = torch.tensor([-1], device=dev), torch.zeros(1, dtype=torch.long, device=dev)
    accepted = torch.zeros(0, dtype=torch.long, device=dev)  # (a,) ids of accepted nodes (root excluded)
    frontier = torch.zeros(0, dtype=torch.long, device=dev)  # (f,) ids found, not accepted
    expand = torch.zeros(1, dtype=torch.long, device=dev)  # the root first
    while True:
        expand = expand[depths[expand] < depth_max]
        if len(expand):
            logits = base[depths[expand]].float() + bias(toks[expand])  # (m, V)
            vals, idx = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)  # (m, k) sorted
            first = len(toks)
            toks = torch.cat([toks, (idx if ids is None else ids[idx]).flatten()])
            scores = torch.cat([scores, (scores[expand, None] + vals).flatten()])
            parents = torch.cat([parents, expand.repeat_interleave(k)])
            depths = torch.cat([depths, (depths[expand] + 1).repeat_interleave(k)])
            frontier = torch.cat([frontier, torch.arange(first, len(toks), device=dev)])
        if not len(frontier):
            break
        order = torch.argsort(-scores[frontier], stable=True)  # (f,) best first
        if len(accepted) < budget:
            take = order[: min(batch, budget - len(accepted))]
        else:
            threshold = torch.topk(scores[accepted], budget).values[-1]
            better = int((scores[frontier[order]] > threshold).sum())
            if better == 0:
                break
            take = order[: min(batch, better)]
        expand = frontier[take]
        accepted = torch.cat([accepted, expand])
        keep = torch.ones(len(frontier), dtype=torch.bool, device=dev)
        keep[take] = False
        frontier = frontier[keep]
    ids, sc, dp = accepted.tolist(), scores[accepted].tolist(), depths[accepted].tolist()
    par, tk = parents.tolist(), toks.tolist()
    return best_nodes(bonus, [(node, par[node], tk[node], d, s) for node, d, s in zip(ids, dp, sc)], budget)


METHODS.update({"dspark": DSparkChain, "ddtree_markov": DDTreeMarkov})
