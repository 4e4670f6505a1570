"""Chunked distribution objective == dense fp64 reference (values and gradients); analytic val metrics."""

from __future__ import annotations

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
