"""DDTree tree construction, flattening and walk (docs/architecture.md, "DDTree"). Plain functions.

Flattened layout: index 0 is the root (the bonus token, depth 0); indices 1..N are the nodes in the
order the best-first heap produced them, which is topological (a parent always precedes its
children). `parents[i]` is a flattened index (-1 for the root).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass
class Tree:
    tokens: list[int]  # (1+N,) flattened tokens, tokens[0] = bonus
    parents: list[int]  # (1+N,) flattened parent index, parents[0] = -1
    depths: list[int]  # (1+N,) depth, depths[0] = 0
    scores: list[float]  # (1+N,) sum of draft log-probs along the path, scores[0] = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> dict[tuple[int, int], int]:
        """(parent index, token) → child index (tokens of siblings are distinct)."""
        return {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens)) if i > 0}


def chain_tree(bonus: int, drafts: list[int]) -> Tree:
    """[bonus, d1..dn] as a one-path tree (a chain method's verify input)."""
    n = 1 + len(drafts)
    return Tree(tokens=[bonus, *drafts], parents=list(range(-1, n - 1)), depths=list(range(n)), scores=[0.0] * n)


def draft_topk(draft_logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """draft_logits (D, V) for depths 1..D → top-k fp32 log-probs at temperature 1 and their tokens."""
    logp = torch.log_softmax(draft_logits.float(), dim=-1)
    vals, idx = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)  # (D, K) sorted descending
    return vals.cpu().tolist(), idx.cpu().tolist()


def build_tree(bonus: int, logp: list[list[float]], tokens: list[list[int]], budget: int) -> Tree:
    """Best-first heap over prefixes scored by summed log-probs; stop at `budget` nodes (root excluded).

    A prefix is (depth d, ranks r_1..r_d); its children/siblings score no higher than itself (log-probs
    <= 0, ranks sorted), so popping in score order yields the `budget` highest-scoring prefixes, and a
    node is only pushed after its parent was popped, so the output is topologically ordered.
    """
    depth_max = len(logp)
    k = len(logp[0]) if depth_max else 0
    tree = Tree(tokens=[bonus], parents=[-1], depths=[0], scores=[0.0])
    if budget <= 0 or depth_max == 0 or k == 0:
        return tree
    counter = 0
    # entry: (-score, tie-break counter, depth, rank, parent index, parent score)
    heap = [(-logp[0][0], counter, 1, 0, 0, 0.0)]
    while heap and len(tree) - 1 < budget:
        neg, _, d, r, parent, parent_score = heapq.heappop(heap)
        node = len(tree)
        tree.tokens.append(tokens[d - 1][r])
        tree.parents.append(parent)
        tree.depths.append(d)
        tree.scores.append(-neg)
        if r + 1 < k:  # next sibling: same parent, next rank at this depth
            counter += 1
            heapq.heappush(heap, (-(parent_score + logp[d - 1][r + 1]), counter, d, r + 1, parent, parent_score))
        if d < depth_max:  # first child: one deeper, rank 0
            counter += 1
            heapq.heappush(heap, (-(-neg + logp[d][0]), counter, d + 1, 0, node, -neg))
    return tree


def graft_chain(tree: Tree, chain: list[int], step_logp: float) -> Tree:
    """`tree` with the path `chain` from its root added: the nodes it shares keep their index (and the higher of the
    two scores), the new ones come after every node of `tree`, in chain order, so the result stays topological.

    The chain's node at depth i scores i · step_logp. Tokens and the acceptance rule are unchanged for every node of
    `tree`; the result holds len(tree) + (the chain's tokens off the tree's paths) nodes."""
    tokens, parents, depths, scores = list(tree.tokens), list(tree.parents), list(tree.depths), list(tree.scores)
    child = tree.children()
    node = 0
    for i, tok in enumerate(chain, start=1):
        nxt = child.get((node, tok))
        if nxt is None:
            nxt = len(tokens)
            tokens.append(tok)
            parents.append(node)
            depths.append(i)
            scores.append(i * step_logp)
            child[(node, tok)] = nxt
        else:
            scores[nxt] = max(scores[nxt], i * step_logp)
        node = nxt
    return Tree(tokens, parents, depths, scores)


def best_nodes(root: int, nodes: list[tuple[int, int, int, int, float]], budget: int) -> Tree:
    """Candidate nodes (id, parent id, token, depth, score; the root's id is 0) of a tree whose scores never rise along
    a path → its `budget` best by score, the shallower first on a tie (in input order after that), as a Tree. A parent
    scores at least its child and is shallower, so the kept set is prefix-closed and comes out topologically ordered."""
    tree = Tree(tokens=[root], parents=[-1], depths=[0], scores=[0.0])
    index = {0: 0}  # node id → its index in `tree`
    for node, parent, token, depth, score in sorted(nodes, key=lambda n: (-n[4], n[3]))[:budget]:
        index[node] = len(tree.tokens)
        tree.tokens.append(token)
        tree.parents.append(index[parent])
        tree.depths.append(depth)
        tree.scores.append(score)
    return tree


def ancestor_matrix(parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents, depths (n,) → bool (n, n): [i, j] = j is i or an ancestor of i.

    Built level by level (topological order guarantees parents' rows are final first).
    """
    n = parents.shape[0]
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    for d in range(1, max_depth + 1):
        rows = (depths == d).nonzero().squeeze(-1)
        anc[rows] |= anc[parents[rows]]
    return anc


def walk(tree: Tree, posterior: list[int]) -> list[int]:
    """Follow the target's posterior from the root while it names a child; → accepted path indices.

    posterior[i] is the target's token after node i's prefix. The path starts at the root (0);
    the next bonus token is posterior[path[-1]].
    """
    children = tree.children()
    path = [0]
    while (nxt := children.get((path[-1], posterior[path[-1]]))) is not None:
        path.append(nxt)
    return path
