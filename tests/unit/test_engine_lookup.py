"""DDTree with a prompt-lookup branch (engine/lookup.py): the n-gram index, the grafted tree, lossless decoding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from draftforge.engine import generate, generate_ar, generate_ddtree, make_method  # noqa: E402
from draftforge.engine.lookup import LOOKUP_DEPTH, MIN_PATH_ACCEPT, NgramIndex  # noqa: E402
from draftforge.engine.methods import Features  # noqa: E402
from draftforge.engine.tree import Tree, build_tree, graft_chain, walk  # noqa: E402
from engine_fixtures import ARCHS, one_thread, prompt, tiny_drafter, tiny_target  # noqa: E402, F401


def test_the_index_finds_the_longest_suffix_at_its_latest_earlier_occurrence():
    ix = NgramIndex(n_min=2, n_max=4)
    ix.reset([5, 1, 2, 9, 7, 1, 2, 3, 8, 1, 2])
    assert ix.continuation(3) == [3, 8, 1]  # (1, 2) last occurred before the end at positions 5–6
    assert ix.continuation(2, after=[3]) == [8, 1]  # (1, 2, 3): the longer suffix wins
    assert ix.continuation(4, after=[4]) == []  # (2, 4) and longer never occurred
    ix.extend([3])  # committed now: the same lookup without `after`
    assert ix.continuation(2) == [8, 1]


def test_the_index_never_matches_the_suffix_itself_and_needs_n_min_tokens():
    ix = NgramIndex(n_min=2, n_max=3)
    ix.reset([4, 6])
    assert ix.continuation(2) == []  # the only (4, 6) is the suffix
    ix.extend([1])
    assert ix.continuation(2, after=[4, 6]) == [1, 4]  # (4, 6) again: what followed the first one
    one = NgramIndex(n_min=2, n_max=2)
    one.reset([7])
    assert one.continuation(3, after=[7]) == []  # (7, 7) never occurred
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramIndex(n_min=3, n_max=2)


def _tree() -> Tree:
    # depth-1 candidates 10 (log p −0.1) and 11 (−1.0), depth-2 candidates 20 (−0.2) and 21 (−2.0)
    return build_tree(9, [[-0.1, -1.0], [-0.2, -2.0]], [[10, 11], [20, 21]], budget=3)


def _prefix_closed_topological(t: Tree) -> bool:
    return all(t.parents[i] < i and t.depths[i] == t.depths[t.parents[i]] + 1 for i in range(1, len(t)))


def test_a_chain_on_the_trees_path_raises_its_scores_and_adds_nothing():
    base = _tree()
    out = graft_chain(base, [10, 20], step_logp=-0.05)
    assert (out.tokens, out.parents, out.depths) == (base.tokens, base.parents, base.depths)
    assert out.scores[out.tokens.index(10)] == pytest.approx(-0.05)
    assert out.scores[out.tokens.index(20)] == pytest.approx(-0.1)  # max(−0.3, 2 · −0.05)


def test_a_diverging_chain_adds_its_nodes_after_the_tree_and_stays_a_tree():
    base = _tree()  # 10, 11 at depth 1 and 20 under 10: the best 3 by summed log-prob
    out = graft_chain(base, [10, 30, 31], step_logp=-0.16)  # shares 10, then leaves the tree
    assert out.tokens[: len(base)] == base.tokens and out.parents[: len(base)] == base.parents  # the tree's nodes kept
    assert out.tokens[len(base) :] == [30, 31] and len(out) == len(base) + 2 and _prefix_closed_topological(out)
    assert out.scores[len(base) :] == pytest.approx([-0.32, -0.48])
    # the walk follows the grafted path like any other
    assert [out.tokens[i] for i in walk(out, [10, 30, 7, 7, 31, 0])] == [9, 10, 30, 31]


def test_the_lookup_offers_its_path_as_deep_as_its_acceptance_pays():
    tm = tiny_target(vocab=8, seed=4)
    method = make_method("ddtree_lookup", tm, tiny_drafter(tm, seed=4, block=4), 2)
    assert method.verify_size == 1 + 2 + LOOKUP_DEPTH
    for accepted, tried in [(0, 0), (9, 10), (30, 30), (0, 8)]:
        method.accepted, method.tried = accepted, tried
        q = (accepted + 1) / (tried + 2)
        depth = method.lookup_depth()
        assert 0 <= depth <= LOOKUP_DEPTH
        assert depth == LOOKUP_DEPTH or q ** (depth + 1) < MIN_PATH_ACCEPT
        assert depth == 0 or q**depth >= MIN_PATH_ACCEPT
    method.accepted, method.tried = 0, 0
    assert method.lookup_depth() == 3  # q = 1/2: 1/8 >= 0.1 > 1/16
    method.accepted, method.tried = 0, 8
    assert method.lookup_depth() == 1  # q = 0.1: depth 1 still pays
    method.accepted, method.tried = 0, 9
    assert method.lookup_depth() == 0  # q = 1/11: nothing offered


@pytest.mark.parametrize(("offered", "path", "tried", "accepted"), [
    (1, [9, 5, 6], 2, 2),  # depth 2 was not offered but the target's token there is known: counted, accepted
    (1, [9, 5], 1, 1),  # depth 2 not offered, the target's token there unknown (the next bonus): not counted
    (2, [9, 5], 2, 1),  # depth 2 offered under an accepted depth 1, and the walk stopped: rejected
    (3, [9, 4, 6], 1, 0),  # depth 1 rejected: nothing deeper counts
])
def test_the_lookup_learns_its_acceptance_from_what_the_target_committed(offered, path, tried, accepted):
    tm = tiny_target(vocab=8, seed=4)
    method = make_method("ddtree_lookup", tm, tiny_drafter(tm, seed=4, block=4), 2)
    method.proposed, method.offered = [5, 6, 7], offered
    method.observe(Features(None, torch.zeros(1, len(path), tm.hidden_size), torch.tensor([path])))
    assert (method.tried, method.accepted) == (tried, accepted)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_lossless_greedy_and_lookups_accepted(arch, seed):
    """Vocabulary 8: greedy text falls into repeats, so the lookup branch is offered and accepted; every budget
    decodes exactly AR's tokens (fp32 CPU), and with room for both branches (budget 32) the grafted tree accepts at
    least as much per round as DDTree's alone on these seeds."""
    tm = tiny_target(arch, vocab=8, seed=seed + 4)
    drafter = tiny_drafter(tm, seed=seed + 4, block=4)
    p = prompt(tm.vocab_size, 9, seed=seed)
    ar = generate_ar(tm, p, 60)
    for budget in (1, 3, 8, 32):
        method = make_method("ddtree_lookup", tm, drafter, budget)
        res = generate(tm, method, p, 60)
        assert res.tokens == ar.tokens, f"budget {budget}"
    assert method.tried > 0 and method.accepted > 0, "the lookup branch was never accepted"
    assert res.tau >= generate_ddtree(tm, drafter, p, 60, budget=32).tau
