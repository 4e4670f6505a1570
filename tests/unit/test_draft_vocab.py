"""The draft vocabulary (drafter.draft_vocab_size; docs/architecture.md, "Draft vocabulary"): its choice, the
objectives over its D rows against dense references, the export in vLLM's layout, and decoding with it losslessly."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftforge.drafter.export import export_drafter, load_drafter
from draftforge.drafter.settings import DrafterConfig
from draftforge.drafter.vocab import choose_draft_vocab, coverage, target_to_draft, to_target_logits
from draftforge.engine import generate_ar, generate_ddtree, generate_dflash
from draftforge.errors import ConfigError, StageError
from draftforge.train.dspark_loss import dense_terms, dist_terms, target_lse
from draftforge.train.loss import block_losses

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_fixtures import (  # noqa: E402,F401
    assert_matches_target_law,
    flat_sampling_target,
    one_thread,
    prompt,
    some_ids,
    tiny_drafter,
    tiny_dspark_drafter,
    tiny_target,
)


def test_the_vocabulary_is_the_most_frequent_labels_ascending_ties_to_the_lower_id():
    counts = torch.tensor([5, 0, 9, 5, 1, 9, 0, 2])
    ids = choose_draft_vocab(counts, 4)
    assert ids.tolist() == [0, 2, 3, 5]  # 9, 9, 5, 5 (ids 0 and 3 tie at 5: both; 1 < 4 ... kept ascending)
    assert coverage(counts, ids) == pytest.approx(28 / 31)
    t2d = target_to_draft(ids, 8)
    assert t2d.tolist() == [0, -1, 1, 2, -1, 3, -1, -1]
    logits = to_target_logits(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), ids, 8)
    assert logits[0, ids].tolist() == [1.0, 2.0, 3.0, 4.0] and torch.isinf(logits[0, [1, 4, 6, 7]]).all()
    with pytest.raises(ValueError, match="0 < size < vocabulary 8"):
        choose_draft_vocab(counts, 8)


def test_only_a_type_that_drafts_from_a_subset_takes_a_draft_vocabulary():
    for kind in ("dflash", "dspark"):
        assert DrafterConfig(name=kind, type=kind, draft_vocab_size=16).draft_vocab_size == 16
    for kind in ("mtp",):
        with pytest.raises(ConfigError, match=f"drafter.draft_vocab_size.*a {kind} drafter drafts from the whole"):
            DrafterConfig(name=kind, type=kind, draft_vocab_size=16)
    with pytest.raises(ConfigError, match="drafter.draft_vocab_size"):
        DrafterConfig(draft_vocab_size=-1)


def _case(seed=0, M=9, V=37, H=8, D=15):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ids = torch.randperm(V, generator=g)[:D].sort().values
    y = torch.randint(0, V, (M,), generator=g)
    y[:3] = ids[:3]  # some data tokens inside the draft vocabulary, the others mostly outside
    return mk(M, H), mk(V, H), y, mk(M, H), ids


@pytest.mark.parametrize("chunk", [4, 1000], ids=["chunked", "whole"])
def test_objective_over_the_draft_rows_equals_the_dense_reference(chunk):
    """q on the D rows, p_t the target's whole-vocabulary distribution: ce (0 outside), restricted kl, and tv
    counting p_t's mass outside the D; values and gradients."""
    h, W, y, ht, ids = _case()
    t2d = target_to_draft(ids, W.shape[0])
    coef = torch.tensor([0.3, 0.5, 1.7], dtype=torch.float64)
    leaf = h.clone().requires_grad_()
    terms, hits = dist_terms(leaf, W[ids], t2d[y], ht, chunk=chunk, lse_full=target_lse(ht, W))
    (terms.double() * coef).sum().backward()
    ref_leaf = h.clone().requires_grad_()
    ref = dense_terms(ref_leaf, W, y, ht, draft_ids=ids)
    (ref * coef).sum().backward()
    assert torch.allclose(terms.double(), ref, atol=1e-6, rtol=1e-6)
    assert torch.allclose(leaf.grad, ref_leaf.grad, atol=1e-5, rtol=1e-5)
    outside = t2d[y] < 0
    assert outside.any() and (terms[outside, 0] == 0).all() and not hits[outside].any()
    p_t = torch.softmax(ht @ W.t(), -1)
    assert torch.allclose(terms[:, 2].double(), 1 - torch.minimum(torch.softmax(h @ W[ids].t(), -1), p_t[:, ids]).sum(-1),
                          atol=1e-6)  # 1 - tv is the chance the draft is accepted


def test_block_ce_over_the_draft_rows_leaves_tokens_outside_them_out_of_the_mean():
    h, W, y, _, ids = _case(seed=2, M=8)
    t2d = target_to_draft(ids, W.shape[0])
    targets, valid = t2d[y].view(1, 2, 4), torch.ones(1, 2, 4, dtype=torch.bool)
    w = torch.tensor([0.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    out = block_losses(h.view(1, 8, -1), W[ids], targets, valid, w, chunk=3)
    known = targets.reshape(-1) >= 0
    wv = w.repeat(2)
    ce = torch.nn.functional.cross_entropy(h[known] @ W[ids].t(), targets.reshape(-1)[known], reduction="none")
    assert torch.allclose(out.weighted_ce_sum, (wv[known] * ce).sum()) and out.weight_sum == wv[known].sum()
    assert not out.correct.reshape(-1)[~known].any()


def test_export_writes_vllms_draft_vocabulary_and_loads_back(tmp_path):
    tm = tiny_target(vocab=96, seed=1)
    ids = torch.arange(0, 96, 3)
    drafter = tiny_drafter(tm, draft_ids=ids)
    out = export_drafter(drafter, drafter.cfg, tmp_path / "drafter", dtype=torch.float32)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"] + torch.arange(32), ids)
    assert torch.equal(tensors["lm_head.weight"], tm.lm_head.weight.detach()[ids])
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 32
    back = load_drafter(out)
    assert back.cfg.draft_vocab_size == 32 and torch.equal(back.draft_ids, ids)
    assert torch.equal(back.draft_head, drafter.draft_head)
    tensors.pop("d2t")
    (out / "model.safetensors").unlink()
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(StageError, match=r"missing \['d2t'\]"):
        load_drafter(out)


def test_dspark_export_with_a_draft_vocabulary_has_a_markov_w2_of_its_rows_and_loads_back(tmp_path):
    """vLLM's DSparkMarkovHead: markov_w1 (V, r) over target ids, markov_w2 (D, r) over the draft rows."""
    tm = tiny_target(vocab=96, seed=1)
    ids = torch.arange(0, 96, 3)
    drafter = tiny_dspark_drafter(tm, rank=8, draft_ids=ids)
    out = export_drafter(drafter, drafter.cfg, tmp_path / "drafter", dtype=torch.float32)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["markov_head.markov_w1.weight"].shape == (96, 8)
    assert tensors["markov_head.markov_w2.weight"].shape == (32, 8)
    assert torch.equal(tensors["d2t"] + torch.arange(32), ids)
    back = load_drafter(out)
    assert back.cfg.draft_vocab_size == 32 and torch.equal(back.draft_ids, ids)
    prev = torch.tensor([0, 5, 95])
    assert torch.equal(back.markov_bias(prev), drafter.markov_bias(prev)) and back.markov_bias(prev).shape == (3, 32)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_decoding_with_a_draft_vocabulary_is_lossless(arch):
    """Greedy DFlash and DDTree equal AR although the target's tokens are often outside the drafter's 40."""
    tm = tiny_target(arch, vocab=96, seed=2)
    ids = some_ids(96, 40)
    drafter = tiny_drafter(tm, seed=2, draft_ids=ids)
    p = prompt(tm.vocab_size, 7, seed=2)
    ar = generate_ar(tm, p, 40)
    assert any(t not in set(ids.tolist()) for t in ar.tokens)
    assert generate_dflash(tm, drafter, p, 40).tokens == ar.tokens
    for budget in (1, 8, 64):
        res = generate_ddtree(tm, drafter, p, 40, budget=budget)
        assert res.tokens == ar.tokens, f"budget {budget}"


def test_sampling_with_a_draft_vocabulary_matches_the_target_distribution():
    """T = 1 on a 4-token vocabulary with a drafter that can draft 3 of them: the first 3 tokens' joint law is
    the target's (Pearson χ², as the whole-vocabulary test in test_engine.py)."""
    tm = flat_sampling_target()
    drafter = tiny_drafter(tm, seed=1, block=4, draft_ids=torch.tensor([0, 1, 3]))
    p, n_tok, n = [0, 1, 2, 1, 3], 3, 2000
    gen = torch.Generator().manual_seed(1234)
    counts: Counter = Counter()
    for _ in range(n):
        res = generate_ddtree(tm, drafter, p, n_tok, budget=12, temperature=1.0, generator=gen)
        counts[tuple(res.tokens)] += 1
    assert any(2 in c for c in counts)  # the undraftable token is generated (by the target's own sample)
    assert_matches_target_law(counts, n, tm, p, n_tok, 1.0)
