"""Chunked distribution objective == dense fp64 reference (values and gradients); analytic val metrics."""

from __future__ import annotations

import math

import pytest
import torch

from draftforge.train.dspark_loss import analytic_stats, dense_terms, dist_terms, objective, summarize_analytic


def _case(seed=0, M=7, V=37, H=8, r=3):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return mk(M, H), mk(V, H), torch.randint(0, V, (M,), generator=g), mk(M, H), mk(M, r), mk(V, r)


@pytest.mark.parametrize("chunk", [5, 37, 1000])
def test_chunked_terms_equal_dense_reference_fp64(chunk):
    h, W, y, ht, e, w2 = _case()
    terms, hits = dist_terms(h, W, y, ht, e, w2, chunk=chunk)
    ref = dense_terms(h, W, y, ht, e, w2)
    assert torch.allclose(terms.double(), ref, atol=1e-6, rtol=1e-6)  # fp32 inside: 1e-6
    assert torch.equal(hits, (h @ W.t() + e @ w2.t()).argmax(-1) == y)
    # no target distribution: CE only
    assert torch.allclose(dist_terms(h, W, y, chunk=chunk)[0][:, 0].double(), dense_terms(h, W, y)[:, 0], atol=1e-6)


@pytest.mark.parametrize("chunk", [6, 1000], ids=["chunked", "whole"])
def test_rows_sharing_a_target_state_equal_the_state_repeated(chunk):
    """Overlapping blocks predict the same position many times: the target's logits are computed once per distinct
    state (t_index) and give the terms and gradients of each row carrying its own copy."""
    h, W, y, ht, e, w2 = _case(seed=3)
    t_index = torch.tensor([0, 2, 2, 1, 0, 2, 3])  # 7 rows over 4 distinct states
    coef = torch.tensor([0.3, 0.5, 1.7], dtype=torch.float64)
    grads = []
    for states, index in ((ht[:4], t_index), (ht[:4][t_index], None)):
        leaf = h.clone().requires_grad_()
        terms, hits = dist_terms(leaf, W, y, states, e, w2, chunk=chunk, t_index=index)
        (terms.double() * coef).sum().backward()
        grads.append((terms, hits, leaf.grad))
    (t1, h1, g1), (t2, h2, g2) = grads
    assert torch.allclose(t1, t2, atol=1e-6) and torch.equal(h1, h2) and torch.allclose(g1, g2, atol=1e-6)
    assert torch.allclose(t1.double(), dense_terms(h, W, y, ht[:4], e, w2, t_index=t_index), atol=1e-6)


@pytest.mark.parametrize("chunk", [6, 1000], ids=["chunked", "whole"])
def test_chunked_gradients_equal_dense_autograd(chunk):
    """Both paths: chunks recomputed in the backward, and one chunk whose q, p_t are kept."""
    h, W, y, ht, e, w2 = _case(seed=1)
    coef = torch.tensor([0.3, 0.5, 1.7], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (h, e, w2)]
    (dist_terms(leaves[0], W, y, ht, leaves[1], leaves[2], chunk=chunk)[0].double() * coef).sum().backward()
    ref = [t.clone().requires_grad_() for t in (h, e, w2)]
    (dense_terms(ref[0], W, y, ht, ref[1], ref[2]) * coef).sum().backward()
    for a, b in zip(leaves, ref):
        assert torch.allclose(a.grad.double(), b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [8, 1000], ids=["chunked", "whole"])
def test_backward_under_autocast_recomputes_the_forward_logits(chunk):
    """Training runs the forward under bf16 autocast and the backward outside it: fp32 drafter states,
    a bf16 LM head. The backward must recompute the forward's (bf16-product) logits, not fail on dtypes."""
    h, W, y, ht, e, w2 = (t.float() if t.is_floating_point() else t for t in _case(seed=2, V=41))
    W16 = W.to(torch.bfloat16)
    coef = torch.tensor([0.3, 0.5, 1.7])
    leaves = [t.clone().requires_grad_() for t in (h, e, w2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        terms, _ = dist_terms(leaves[0], W16, y, ht, leaves[1], leaves[2], chunk=chunk)
    (terms.float() * coef).sum().backward()
    ref = [t.to(torch.bfloat16).double().requires_grad_() for t in (h, e, w2)]  # the products' inputs, rounded
    (dense_terms(ref[0], W16.double(), y, ht.to(torch.bfloat16).double(), ref[1], ref[2]) * coef.double()).sum().backward()
    for a, b in zip(leaves, ref):
        assert a.grad.dtype == torch.float32 and torch.allclose(a.grad.double(), b.grad, atol=3e-2, rtol=3e-2)


def test_the_whole_vocabulary_is_one_chunk_only_when_its_probabilities_fit():
    from draftforge.train.dspark_loss import WHOLE_VOCAB_BYTES, effective_chunk

    assert effective_chunk(512, 49152, True, 8192) == 49152  # the CPU default world: 200 MB kept
    assert effective_chunk(16384, 151936, True, 8192) == 8192  # a GPU batch: 20 GB would be kept
    rows = WHOLE_VOCAB_BYTES // (4 * 1000)
    assert effective_chunk(rows, 1000, False, 64) == 1000 and effective_chunk(rows + 1, 1000, False, 64) == 64
    assert effective_chunk(rows, 1000, True, 64) == 64  # q and p_t: twice the bytes


def test_objective_requires_the_target_distribution_for_tv():
    h, W, y, ht, e, w2 = _case()
    with pytest.raises(ValueError, match="target's last hidden"):
        objective(h, W, y, torch.ones(7), {"tv": 1.0})
    out = objective(h.float(), W.float(), y, torch.ones(7), {"tv": 1.8, "ce": 0.1}, ht=ht.float(),
                    conf_logit=torch.zeros(7), conf_weight=1.0)
    assert out.accept is not None and torch.all((out.accept >= 0) & (out.accept <= 1))


def test_acceptance_weighting_multiplies_each_row_by_its_chance_of_being_reached():
    """Rows (block, k): weight × Π_{j<k} a_j of the same block, a missing row ending the product; the loss
    sum equals that formula, and the weights carry no gradient."""
    from draftforge.train.dspark_loss import reach_weights

    accept = torch.tensor([0.5, 0.4, 0.9, 0.2, 0.7])
    block = torch.tensor([0, 0, 0, 1, 1])
    k = torch.tensor([0, 1, 2, 0, 2])  # block 1 lacks k = 1: its k = 2 is not reached
    assert torch.allclose(reach_weights(accept, block, k, 2, 3), torch.tensor([1.0, 0.5, 0.2, 1.0, 0.0]))
    h, W, y, ht, _, _ = _case()
    h = h.float().requires_grad_()
    rows = torch.arange(7)
    reach = (rows // 3, rows % 3, 3, 3)
    plain = objective(h, W.float(), y, torch.ones(7), {"tv": 1.8, "ce": 0.1}, ht=ht.float())
    out = objective(h, W.float(), y, torch.ones(7), {"tv": 1.8, "ce": 0.1}, ht=ht.float(), reach=reach)
    w = reach_weights(plain.accept, *reach)
    per_row = plain.terms[:, 0] * 0.1 + plain.terms[:, 2] * 1.8
    assert torch.allclose(out.weighted_sum, (w * per_row).sum()) and torch.allclose(out.weight_sum, w.sum())
    assert not w.requires_grad and w[0] == 1.0 and bool((w[1:3] < 1).all())
    out.weighted_sum.backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
    with pytest.raises(ValueError, match="acceptance weighting need"):
        objective(h, W.float(), y, torch.ones(7), {"ce": 1.0}, reach=reach)


def test_analytic_tau_and_calibration():
    # two blocks of 3 drafts: τ = 1 + a0 + a0a1 + a0a1a2; the second block lacks its last row
    accept = torch.tensor([0.5, 0.5, 1.0, 1.0, 0.2])
    k = torch.tensor([0, 1, 2, 0, 1])
    blk = torch.tensor([0, 0, 0, 1, 1])
    conf = torch.tensor([0.55, 0.45, 0.95, 0.95, 0.25])
    m = summarize_analytic(analytic_stats(accept, conf, k, blk, 2, 3), 3, True)
    assert m["analytic_tau"] == pytest.approx(((1 + 0.5 + 0.25 + 0.25) + (1 + 1 + 0.2)) / 2)
    assert m["analytic_accept_0"] == pytest.approx(0.75)
    assert m["conf_ece"] == pytest.approx((0.05 + 0.05 + 0.05 + 0.05 + 0.05) / 5)


# ---------------------------------------------------------------- the objective pinned against a hand computation
# A tiny hand-built world (one sequence of 9 tokens, vocabulary 5, width 3, blocks of 3 at anchors 1 and 6): the
# objective `train.loop.dist_block_losses` computes equals the module docstring's formula evaluated below with
# plain torch ops, row by row. What a lossless engine cannot see is pinned here: which target position p_t is read
# (the state at p - 1 for a row predicting p) and how the position decay and acceptance weighting combine.
_IDS = [4, 0, 2, 1, 3, 0, 4, 2, 1]
_ANCHORS = [1, 6]
_B, _V, _H, _GAMMA = 3, 5, 3, 2.0


def _hand_world():
    g = torch.Generator().manual_seed(11)
    lm_head = torch.randn(_V, _H, generator=g, dtype=torch.float64)
    last = torch.randn(len(_IDS), _H, generator=g, dtype=torch.float64) * 2.0  # the target's state per position
    h = torch.randn(1, len(_ANCHORS) * _B, _H, generator=g, dtype=torch.float64)  # drafter output per block slot
    return lm_head, last, h


def _loop_objective(first_slot: int, pred_offset: int, weights: dict, acceptance_weighting: bool = False):
    from types import SimpleNamespace

    from draftforge.train.data import collate
    from draftforge.train.loop import Objective, dist_block_losses
    from draftforge.train.loss import slot_weights

    lm_head, last, h = _hand_world()
    T = len(_IDS)
    item = (torch.tensor(_IDS), torch.ones(T, dtype=torch.uint8), torch.zeros(T, 2), last)
    batch = collate([item], [torch.tensor(_ANCHORS)], _B, mask_token_id=0, feat_dtype=torch.float64,
                    first_slot=first_slot, pred_offset=pred_offset)
    model = SimpleNamespace(cfg=SimpleNamespace(first_slot=first_slot, pred_offset=pred_offset, draft_vocab_size=0))  # a plain (non-DSpark) drafter
    head = SimpleNamespace(lm_head=lm_head)
    obj = Objective(dict(weights), chunk=1000, acceptance_weighting=acceptance_weighting)
    return dist_block_losses(model, h, head, batch, slot_weights(_B, _GAMMA, first_slot).double(), obj)


def _hand_rows(first_slot: int, pred_offset: int):
    """Per supervised row, by hand: (block, draft index k, ce, kl, tv) with p = anchor + slot + pred_offset,
    q = softmax(lm_head · h_slot), p_t = softmax(lm_head · last[p - 1])."""
    lm_head, last, h = _hand_world()
    rows = []
    for n, a in enumerate(_ANCHORS):
        for slot in range(first_slot, _B):
            p = a + slot + pred_offset
            if p >= len(_IDS):
                continue
            z = lm_head @ h[0, n * _B + slot]
            t = lm_head @ last[p - 1]
            q = torch.exp(z) / torch.exp(z).sum()
            pt = torch.exp(t) / torch.exp(t).sum()
            ce = -torch.log(q[_IDS[p]])
            kl = (pt * (torch.log(pt) - torch.log(q))).sum()
            tv = 0.5 * (q - pt).abs().sum()
            rows.append((n, slot - first_slot, float(ce), float(kl), float(tv)))
    return rows


@pytest.mark.parametrize("first_slot,pred_offset", [(0, 1), (1, 0)], ids=["dspark_block", "fill_in_block"])
def test_objective_reads_the_target_distribution_before_the_predicted_position(first_slot, pred_offset):
    """λ_ce·CE + λ_kl·KL + λ_tv·TV with decay exp(-k/γ), normalised: equal to the hand value (p_t from the target's
    state at p - 1; a one-position shift changes KL and TV and fails this)."""
    lam = {"ce": 0.3, "kl": 0.7, "tv": 1.8}
    out = _loop_objective(first_slot, pred_offset, lam)
    rows = _hand_rows(first_slot, pred_offset)
    assert len(rows) == int(out.valid.sum()) == (5 if first_slot == 0 else 4)  # anchor 6's slot 2 would predict 9: outside
    num = den = 0.0
    for _, k, ce, kl, tv in rows:
        w = math.exp(-k / _GAMMA)
        num += w * (lam["ce"] * ce + lam["kl"] * kl + lam["tv"] * tv)
        den += w
    assert float(out.weight_sum) == pytest.approx(den, rel=1e-6)
    assert float(out.weighted_ce_sum) / float(out.weight_sum) == pytest.approx(num / den, rel=1e-5)
    terms = out.extra.terms.double()  # (rows, [ce, kl, tv]) in row order
    want = torch.tensor([[ce, kl, tv] for _, _, ce, kl, tv in rows], dtype=torch.float64)
    assert torch.allclose(terms, want, atol=1e-5), (terms, want)


@pytest.mark.parametrize("first_slot,pred_offset", [(0, 1), (1, 0)], ids=["dspark_block", "fill_in_block"])
def test_acceptance_weighting_multiplies_the_position_decay(first_slot, pred_offset):
    """Each row's weight = exp(-k/γ) × Π_{j<k} (1 - tv_j) of its block, by hand (decay × reach, not reach alone)."""
    lam = {"ce": 1.0}
    out = _loop_objective(first_slot, pred_offset, lam, acceptance_weighting=True)
    rows = _hand_rows(first_slot, pred_offset)
    reach: dict[int, float] = {}
    num = den = 0.0
    for n, k, ce, _, tv in rows:
        r = reach.get(n, 1.0)
        w = math.exp(-k / _GAMMA) * r
        reach[n] = r * (1.0 - tv)
        num += w * ce
        den += w
    assert float(out.weight_sum) == pytest.approx(den, rel=1e-6)
    assert float(out.weighted_ce_sum) == pytest.approx(num, rel=1e-5)
