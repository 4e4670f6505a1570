"""DDTree with a prompt-lookup branch (engine/lookup.py): the n-gram index, the grafted tree, lossless decoding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.engine import generate, generate_ar, generate_ddtree, make_method  # noqa: E402
from draftforge.engine.lookup import NgramIndex  # noqa: E402
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
    out = graft_chain(base, [10, 20], step_logp=-0.05, budget=3)
    assert sorted(zip(out.tokens, out.depths)) == sorted(zip(base.tokens, base.depths))
    assert out.scores[out.tokens.index(10)] == pytest.approx(-0.05)
    assert out.scores[out.tokens.index(20)] == pytest.approx(-0.1)  # max(−0.3, 2 · −0.05)


def test_a_diverging_chain_takes_the_budget_by_score_and_stays_a_tree():
    base = _tree()  # nodes 10, 11 at depth 1 (or 20 at depth 2): the best 3 by summed log-prob
    out = graft_chain(base, [12, 30, 31], step_logp=-0.16, budget=3)  # −0.16, −0.32, −0.48
    assert len(out) == 4 and _prefix_closed_topological(out)
    assert out.tokens[1:] == [10, 12, 20]  # by score: 10 (−0.1), 12 (−0.16), 20 (−0.3); 30 (−0.32) and 11 dropped
    kept = graft_chain(base, [12, 30, 31], step_logp=-0.01, budget=4)
    assert kept.tokens[1:4] == [12, 30, 31] and _prefix_closed_topological(kept)
    # the walk follows the grafted path like any other
    assert [kept.tokens[i] for i in walk(kept, [12, 30, 31, 7, 0])] == [9, 12, 30, 31]


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
