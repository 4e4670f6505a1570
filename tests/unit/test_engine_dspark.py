"""DSpark engine methods: lossless at T=0 (seeds × budgets), T>0 distribution (chi-square), tree rules."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftforge.engine import (  # noqa: E402
    generate,
    generate_ar,
    make_method,  # noqa: E402
)
from draftforge.engine.dspark import build_markov_tree  # noqa: E402
from draftforge.engine.tree import build_tree, draft_topk  # noqa: E402
from engine_fixtures import (  # noqa: E402
    ARCHS,
    assert_matches_target_law,
    flat_sampling_target,
    one_thread,  # noqa: F401  (autouse fixture)
    prompt,
    some_ids,
    tiny_drafter,
    tiny_dspark_drafter,
    tiny_target,
)


@pytest.mark.parametrize("seed", range(5))
def test_lossless_greedy_seeds_and_budgets(seed):
    tm = tiny_target(ARCHS[seed % 2], vocab=96 if seed < 3 else 8, seed=seed)
    drafter = tiny_dspark_drafter(tm, seed=seed, bonus_anchor=seed == 4)
    p = prompt(tm.vocab_size, 7, seed=seed)
    ar = generate_ar(tm, p, 30).tokens
    res = generate(tm, make_method("dspark", tm, drafter), p, 30)
    assert res.tokens == ar
    for budget in (1, 4, 16, 64):
        res = generate(tm, make_method("ddtree_markov", tm, drafter, budget), p, 30)
        assert res.tokens == ar, f"budget {budget}"
        assert sum(res.accept_lengths) >= len(ar) - 1
    assert generate(tm, make_method("ddtree", tm, drafter, 16), p, 30).tokens == ar  # marginal tree, same drafter
    for budget in (1, 4):  # its tree plus the prompt-lookup path (vocab 8: the lookup matches often)
        assert generate(tm, make_method("ddtree_lookup", tm, drafter, budget), p, 30).tokens == ar, f"lookup {budget}"


@pytest.mark.parametrize("seed", range(3))
def test_lossless_with_a_draft_vocabulary(seed):
    """A DSpark drafter over a draft vocabulary (its Markov W2 has D rows): every method equals AR, and the chain
    drafts only the D tokens."""
    tm = tiny_target(ARCHS[seed % 2], vocab=96 if seed < 2 else 8, seed=seed)
    ids = some_ids(tm.vocab_size, tm.vocab_size // 2, seed=seed)
    drafter = tiny_dspark_drafter(tm, seed=seed, bonus_anchor=seed == 2, draft_ids=ids)
    assert drafter.markov_head.markov_w2.weight.shape[0] == len(ids)
    p = prompt(tm.vocab_size, 7, seed=seed)
    ar = generate_ar(tm, p, 30).tokens
    assert generate(tm, make_method("dspark", tm, drafter), p, 30).tokens == ar
    for budget in (1, 4, 16, 64):
        assert generate(tm, make_method("ddtree_markov", tm, drafter, budget), p, 30).tokens == ar, budget
    assert generate(tm, make_method("ddtree", tm, drafter, 16), p, 30).tokens == ar
    assert generate(tm, make_method("ddtree_lookup", tm, drafter, 4), p, 30).tokens == ar
    m = make_method("dspark", tm, drafter)
    m.begin(_features(tm, p))
    assert set(m.draft(tm.vocab_size - 1, len(p)).tolist()) <= set(ids.tolist())


@pytest.mark.parametrize("draft_vocab", [0, 40], ids=["whole_vocabulary", "draft_vocabulary"])
def test_dspark_chain_drafts_the_markov_argmax_left_to_right(draft_vocab):
    """x_d = argmax(z_d + W1[x_{d-1}] · W2ᵀ), left to right. With a draft vocabulary z and W2 have its D rows, and
    the argmax column becomes its target id, which conditions the next draft."""
    tm = tiny_target(vocab=96, seed=1)
    ids = some_ids(96, draft_vocab, seed=1) if draft_vocab else None
    d = tiny_dspark_drafter(tm, seed=1, draft_ids=ids)
    m = make_method("dspark", tm, d)
    assert m.verify_size == 1 + d.cfg.block_size  # every slot drafts (anchor-as-first-prediction)
    m.begin(_features(tm, prompt(96, 7)))
    base = m.base_logits(17, 7).double()
    assert base.shape == (d.cfg.n_draft, draft_vocab or 96) and torch.isfinite(base).all()
    m2 = make_method("dspark", tm, d)
    m2.begin(_features(tm, prompt(96, 7)))
    toks = m2.draft(17, 7).tolist()
    W1, W2 = d.markov_head.markov_w1.weight.double(), d.markov_head.markov_w2.weight.double()
    prev, want = 17, []
    for row in base:
        column = int((row + W1[prev] @ W2.t()).argmax())
        prev = column if ids is None else int(ids[column])
        want.append(prev)
    assert toks == want


def _features(tm, p):
    from draftforge.engine.methods import Features
    from draftforge.engine.span import chain_span
    from draftforge.engine.state import TargetState
    from draftforge.engine.target import forward

    state = TargetState(tm, 64)
    h, taps = forward(tm, state, chain_span(torch.tensor([p]), 0, tm.dtype, commit_all=True), True)
    return Features(taps, h)


def test_markov_tree_with_zero_bias_is_ddtree_and_children_follow_their_parent():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 11, generator=g)
    for budget in (1, 7, 40):
        logp, toks = draft_topk(base, min(budget, 11))
        ref = build_tree(2, logp, toks, budget)
        got = build_markov_tree(2, base, lambda prev: 0, budget)
        assert (got.tokens, got.parents, got.depths) == (ref.tokens, ref.parents, ref.depths)
        assert got.scores == pytest.approx(ref.scores, abs=1e-5)
    # a bias that makes the child token equal to (parent + 1) mod V: every first child follows its parent
    bias = lambda prev: 50.0 * torch.nn.functional.one_hot((prev + 1) % 11, 11).float()  # noqa: E731
    tree = build_markov_tree(2, base, bias, 30)
    first_child = {}
    for i in range(1, len(tree)):
        first_child.setdefault(tree.parents[i], i)
    for parent, child in first_child.items():
        assert tree.tokens[child] == (tree.tokens[parent] + 1) % 11
    assert len(tree) == 31 and all(tree.parents[i] < i for i in range(1, 31))


@pytest.mark.parametrize("markov", [False, True], ids=["zero_bias", "markov_bias"])
def test_markov_tree_reaches_the_deepest_drafted_depth(markov):
    """Every depth the drafter drafts is expandable: with one confident token per depth (a spine scoring ~0, the
    rest far below) a budget of exactly D nodes is the whole spine, a chain down to depth D, and larger budgets
    keep the tree's maximum depth at D (siblings fill the rest). The marginal tree (`build_tree`) likewise."""
    D, V, bonus = 5, 11, 2
    spine = [7, 1, 9, 4, 0]
    base = torch.full((D, V), -12.0)
    for d, tok in enumerate(spine):
        base[d, tok] = 12.0
        base[d, (tok + 3) % V] = 0.0  # a runner-up sibling per depth
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, V, generator=g) * 0.5
    bias = (lambda prev: w[prev]) if markov else (lambda prev: 0)
    for budget in (D, D + 3, 4 * D):
        for tree in (build_markov_tree(bonus, base, bias, budget), build_tree(bonus, *draft_topk(base, min(budget, V)), budget)):
            assert len(tree) == budget + 1 and max(tree.depths) == D, (budget, tree.depths)
            if budget == D:
                assert tree.tokens == [bonus, *spine] and tree.depths == list(range(D + 1)) and tree.is_chain


def test_dflash_drafter_refuses_dspark_methods():
    tm = tiny_target(vocab=96, seed=0)
    d = tiny_drafter(tm)
    for name in ("dspark", "ddtree_markov"):
        with pytest.raises(ValueError, match="needs a DSpark drafter"):
            make_method(name, tm, d, 4)


@pytest.mark.parametrize("method", ["ddtree_markov", pytest.param("dspark", marks=pytest.mark.integration)])
def test_sampling_matches_target_distribution(method):
    """As the DFlash/DDTree chi-square test: first 3 tokens at T=1 on a 4-token vocabulary."""
    tm = flat_sampling_target()
    drafter = tiny_dspark_drafter(tm, seed=1, block=3, rank=4)
    p, n_tok, n = [0, 1, 2, 1, 3], 3, 2000
    gen = torch.Generator().manual_seed(1234)
    counts: Counter = Counter()
    deep = 0
    for _ in range(n):
        res = generate(tm, make_method(method, tm, drafter, 12), p, n_tok, temperature=1.0, generator=gen)
        counts[tuple(res.tokens)] += 1
        deep += res.accept_lengths[0] >= 2
    assert deep > n // 10

    assert_matches_target_law(counts, n, tm, p, n_tok, 1.0)


def test_markov_argmax_is_the_full_vocabulary_argmax():
    """The bounded search (top-k by an upper bound, exact scores, grow k until the bound excludes the rest)
    returns the full-vocabulary argmax of z + W2·e, also when the bias moves the winner far down z's ranking."""
    from draftforge.engine.dspark import markov_argmax

    g = torch.Generator().manual_seed(0)
    V, r = 5000, 16
    for trial in range(40):
        z = torch.randn(V, generator=g, dtype=torch.float64) * (0.1 if trial % 2 else 3.0)
        w2 = torch.randn(V, r, generator=g, dtype=torch.float64) * (2.0 if trial % 3 == 0 else 0.2)
        e = torch.randn(r, generator=g, dtype=torch.float64)
        full = int((z + w2 @ e).argmax())
        assert markov_argmax(z, e, w2, w2.norm(dim=1), k=4) == full, trial


def test_markov_tree_is_the_budget_best_prefixes_by_brute_force():
    """Every prefix up to the drafted depth scored by its conditioned log-probs; the tree holds exactly the
    `budget` best, parents before children."""
    import itertools

    g = torch.Generator().manual_seed(5)
    V, D = 6, 3
    for trial in range(6):
        base = 3 * torch.randn(D, V, generator=g)
        table = 3 * torch.randn(V, V, generator=g)  # bias(x) = table[x]
        scores = {}
        for depth in range(1, D + 1):
            for path in itertools.product(range(V), repeat=depth):
                prev, s = 2, 0.0
                for d, tok in enumerate(path):
                    s += float(torch.log_softmax(base[d] + table[prev], -1)[tok])
                    prev = tok
                scores[path] = s
        for budget, batch in itertools.product((1, 5, 17, 40), (1, 3, 8)):
            want = set(sorted(scores, key=lambda p: -scores[p])[:budget])
            rows: list[int] = []
            bias = lambda prev, rows=rows, table=table: rows.append(len(prev)) or table[prev]  # noqa: E731
            tree = build_markov_tree(2, base, bias, budget, batch)
            if batch == 1:  # lazy expansion: the root and accepted nodes only, each once
                assert sum(rows) <= budget + 1, (trial, budget, rows)
            paths = []
            for i in range(1, len(tree)):
                assert tree.parents[i] < i, (trial, budget)
                parent = paths[tree.parents[i] - 1] if tree.parents[i] > 0 else ()
                paths.append(parent + (tree.tokens[i],))
            assert set(paths) == want, (trial, budget, batch)
            assert tree.scores[1:] == pytest.approx([scores[p] for p in paths], abs=1e-4)


def test_markov_tree_over_a_draft_vocabulary_is_the_budget_best_prefixes_by_brute_force():
    """Columns are a draft vocabulary's rows: children are ranked over the D columns, a node's token is its
    column's target id, and the bias is asked of that target id."""
    import itertools

    g = torch.Generator().manual_seed(7)
    V, D, depth = 9, 4, 3
    ids = torch.tensor([1, 4, 5, 8])
    for trial in range(4):
        base = 3 * torch.randn(depth, D, generator=g)
        table = 3 * torch.randn(V, D, generator=g)  # bias(target id x) over the D columns
        scores = {}
        for n in range(1, depth + 1):
            for path in itertools.product(range(D), repeat=n):
                prev, s = 2, 0.0
                for d, col in enumerate(path):
                    s += float(torch.log_softmax(base[d] + table[prev], -1)[col])
                    prev = int(ids[col])
                scores[tuple(int(ids[c]) for c in path)] = s
        for budget, batch in itertools.product((1, 6, 30), (1, 8)):
            want = set(sorted(scores, key=lambda p: -scores[p])[:budget])
            tree = build_markov_tree(2, base, lambda prev, table=table: table[prev], budget, batch, ids=ids)
            paths = []
            for i in range(1, len(tree)):
                parent = paths[tree.parents[i] - 1] if tree.parents[i] > 0 else ()
                paths.append(parent + (tree.tokens[i],))
            assert set(paths) == want, (trial, budget, batch)
            assert tree.scores[1:] == pytest.approx([scores[p] for p in paths], abs=1e-4)
