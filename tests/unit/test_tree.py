"""DDTree tree build (optimality vs brute force, prefix closure, topological order), mask/positions, walk."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from draftforge.engine.span import tree_span
from draftforge.engine.tree import Tree, ancestor_matrix, build_tree, draft_topk, walk


def _random_draft(depth: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(depth, vocab, generator=g) * 2.0  # (D, V) draft logits


def _prefixes(tree: Tree) -> list[tuple[int, ...]]:
    """Token prefix of every non-root node (root excluded)."""
    out = []
    for i in range(1, len(tree)):
        path, j = [], i
        while j > 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [1, 2, 7, 20, 60])
def test_build_tree_is_optimal_vs_brute_force(seed, budget):
    depth, vocab = 3, 5
    logits = _random_draft(depth, vocab, seed)
    logp, toks = draft_topk(logits, min(budget, vocab))
    tree = build_tree(bonus=99, logp=logp, tokens=toks, budget=budget)
    # Brute force: score every prefix of length 1..depth over the full vocabulary.
    full = torch.log_softmax(logits.float(), -1)
    scored = []
    for d in range(1, depth + 1):
        for pre in itertools.product(range(vocab), repeat=d):
            scored.append((sum(full[i, t].item() for i, t in enumerate(pre)), pre))
    scored.sort(reverse=True)
    n = min(budget, len(scored))
    assert len(tree) - 1 == n
    best = {pre for _, pre in scored[:n]}
    assert set(_prefixes(tree)) == best
    # Node scores are the prefix log-probabilities.
    for score, pre in zip(tree.scores[1:], _prefixes(tree)):
        assert math.isclose(score, sum(full[i, t].item() for i, t in enumerate(pre)), abs_tol=1e-5)


@pytest.mark.parametrize("budget", [1, 16, 300])
def test_tree_prefix_closed_topological_and_distinct_siblings(budget):
    logp, toks = draft_topk(_random_draft(6, 40, seed=7), min(budget, 40))
    tree = build_tree(5, logp, toks, budget)
    assert tree.tokens[0] == 5 and tree.parents[0] == -1 and tree.depths[0] == 0
    assert len(tree) - 1 == budget
    prefixes = set(_prefixes(tree))
    for i in range(1, len(tree)):
        p = tree.parents[i]
        assert 0 <= p < i  # topological: parent first
        assert tree.depths[i] == tree.depths[p] + 1
        assert tree.scores[i] <= tree.scores[p] + 1e-9  # monotone along a path
    for pre in prefixes:  # prefix closure
        assert len(pre) == 1 or pre[:-1] in prefixes
    assert len(tree.children()) == len(tree) - 1  # no (parent, token) pair twice
    # Pop order is best-first: scores non-increasing in flattened order.
    assert all(a >= b - 1e-9 for a, b in zip(tree.scores[1:], tree.scores[2:]))


def test_topk_uses_fp32_logsoftmax_at_temperature_one():
    logits = _random_draft(2, 10, seed=3).to(torch.bfloat16)
    logp, toks = draft_topk(logits, 4)
    ref = torch.log_softmax(logits.float(), -1)
    assert toks[0] == ref[0].topk(4).indices.tolist()
    assert logp[0] == pytest.approx(ref[0].topk(4).values.tolist(), abs=1e-6)


def test_mask_and_positions_vs_brute_force():
    logp, toks = draft_topk(_random_draft(5, 12, seed=11), 12)
    tree = build_tree(7, logp, toks, budget=40)
    start = 9
    span = tree_span(tree, start, torch.device("cpu"), torch.float32, conv_kernel=4)
    ids, pos, mask = span.ids, span.positions, span.mask
    n = len(tree)
    assert ids.tolist() == [tree.tokens]
    assert mask.shape == (1, 1, n, start + n)
    for i in range(n):
        ancestors, j = set(), i
        while j >= 0:
            ancestors.add(j)
            j = tree.parents[j]
        assert pos[i].item() == start + len(ancestors) - 1  # depth-based; siblings share one
        for col in range(start + n):
            visible = col < start or (col - start) in ancestors
            assert mask[0, 0, i, col].item() == (0.0 if visible else float("-inf"))
        chain = [i]  # i's o-th ancestors (the conv window), -1 past the root
        while len(chain) < 4:
            chain.append(tree.parents[chain[-1]] if chain[-1] >= 0 else -1)
        assert span.anc_at[i].tolist() == chain


def test_ancestor_matrix_chain_and_star():
    chain = ancestor_matrix(torch.tensor([0, 0, 1, 2]), torch.tensor([0, 1, 2, 3]), 3)
    assert torch.equal(chain, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    star = ancestor_matrix(torch.tensor([0, 0, 0, 0]), torch.tensor([0, 1, 1, 1]), 1)
    expect = torch.eye(4, dtype=torch.bool)
    expect[:, 0] = True
    assert torch.equal(star, expect)


def test_walk_follows_posterior_to_deepest_match():
    # root(0) → a(1, tok 10), b(2, tok 11); a → c(3, tok 20); c → d(4, tok 30)
    tree = Tree(tokens=[1, 10, 11, 20, 30], parents=[-1, 0, 0, 1, 3], depths=[0, 1, 1, 2, 3], scores=[0] * 5)
    assert walk(tree, [10, 20, 0, 31, 0]) == [0, 1, 3]  # mismatch at c: next bonus is posterior[3] = 31
    assert walk(tree, [11, 0, 5, 0, 0]) == [0, 2]
    assert walk(tree, [12, 0, 0, 0, 0]) == [0]
    assert walk(tree, [10, 20, 0, 30, 8]) == [0, 1, 3, 4]
