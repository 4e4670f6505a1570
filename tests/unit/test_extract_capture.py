"""Extraction exactness: hooks + length-bucketed right-padded batches equal one-sequence forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftforge.extract.batching import make_batches, pad_batch
from draftforge.extract.capture import TapCapture
from draftforge.target.config import RandomTargetConfig
from draftforge.target.random import build_random_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def model(request):
    m = build_random_model(RandomTargetConfig(architecture=request.param, num_layers=4))
    m.set_attn_implementation("eager")  # the stage's CPU choice (see extract.attn_implementation)
    return m


def reference(model, ids: np.ndarray, taps: list[int]) -> torch.Tensor:
    """One-sequence forward, HF convention: layer id L = hidden_states[L+1] → (T, n_taps·H)."""
    with torch.no_grad():
        hs = model(torch.from_numpy(ids).long()[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[L + 1][0] for L in taps], dim=-1)


def extract_packed(model, taps, lengths, ids, tokens_per_batch, stop=True) -> torch.Tensor:
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    cap = TapCapture(model, taps, stop_after_last=stop)
    out = []
    for b in make_batches(np.asarray(lengths), tokens_per_batch):
        x, mask, valid = pad_batch(ids, offsets, b, pad_id=0, device=CPU)
        out.append(cap.run(x, mask, valid))
    return torch.cat(out)


def _compare(model, lengths: list[int], tokens_per_batch: int, seed: int = 0) -> list[tuple[float, float]]:
    """Per sequence: (max abs diff batched vs alone, max |value|)."""
    ids = np.random.default_rng(seed).integers(6, 512, size=sum(lengths))
    taps = [0, 1, 2]
    got = extract_packed(model, taps, lengths, ids, tokens_per_batch)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    assert got.shape == (sum(lengths), 3 * 128)
    out = []
    for s in range(len(lengths)):
        ref = reference(model, ids[offsets[s] : offsets[s + 1]], taps)
        out.append(((got[offsets[s] : offsets[s + 1]] - ref).abs().max().item(), ref.abs().max().item()))
    return out


def test_batched_equals_single_sequence(model):
    # Batches mix lengths: [130, 97] (33 pad positions), [64, 40, 40, 17] (up to 47), [16].
    lengths = [130, 97, 64, 40, 40, 17, 16]
    diffs = _compare(model, lengths, tokens_per_batch=260)
    worst = max(d for d, _ in diffs)
    # Observed: bit-identical (0.0) with eager attention on CPU; the bar is 1e-5.
    assert worst <= 1e-5, f"batched extraction differs from one-sequence forward by {worst}: {diffs}"


def test_short_sequences_match_to_blas_rounding(model):
    """Below 16 tokens the one-sequence reference's own GEMMs (M < 16 rows) take another BLAS kernel,
    so values agree to a few ulp of the largest value rather than bit for bit."""
    diffs = _compare(model, [40, 15, 9, 3, 2, 1], tokens_per_batch=120, seed=1)
    for d, scale in diffs:
        assert d <= 1e-5 * scale, diffs

def test_batches_really_pad():
    batches = make_batches(np.array([61, 47, 47, 30, 9, 2, 1]), 160)
    assert any(b.stop - b.first > 1 and b.padded_len * (b.stop - b.first) > b.n_tokens for b in batches)
    assert all(b.padded_len * (b.stop - b.first) <= 160 for b in batches if b.stop - b.first > 1)
    assert [b.token_start for b in batches] == [0, *np.cumsum([b.n_tokens for b in batches])[:-1].tolist()]


def test_batch_fill_bounds_the_padding_of_every_batch():
    lengths = np.array([100, 95, 50, 48, 10])
    batches = make_batches(lengths, 10_000, fill=0.9)
    assert [(b.first, b.stop) for b in batches] == [(0, 2), (2, 4), (4, 5)]
    assert all(b.n_tokens >= 0.9 * b.padded_len * (b.stop - b.first) for b in batches)
    assert [(b.first, b.stop) for b in make_batches(lengths, 10_000)] == [(0, 5)]  # no fill: one batch


def test_layer_id_convention_is_output_of_layer(model):
    """Tap L must be hidden_states[L+1], and must differ from the off-by-one hidden_states[L]."""
    ids = np.arange(6, 40)
    with torch.no_grad():
        hs = model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
    for L in (0, 2):
        got = extract_packed(model, [L], [len(ids)], ids, 4096)
        assert torch.equal(got, hs[L + 1][0])
        assert not torch.allclose(got, hs[L][0], atol=1e-3)


def test_early_stop_skips_later_layers(model):
    before = len(model.model.layers[2]._forward_hooks)
    ran = []
    handle = model.model.layers[3].register_forward_hook(lambda *a: ran.append(1))
    lm = model.lm_head.register_forward_hook(lambda *a: ran.append(2))
    try:
        ids = np.arange(6, 30)
        stopped = extract_packed(model, [0, 2], [len(ids)], ids, 4096, stop=True)
        assert ran == []
        full = extract_packed(model, [0, 2], [len(ids)], ids, 4096, stop=False)
        assert ran == [1]  # base model only: the LM head never runs
        assert torch.equal(stopped, full)
    finally:
        handle.remove()
        lm.remove()
    assert len(model.model.layers[2]._forward_hooks) == before  # capture hooks removed after each run


def test_bad_taps_refused(model):
    with pytest.raises(ValueError, match="outside"):
        TapCapture(model, [1, 4])
    with pytest.raises(ValueError, match="increasing"):
        TapCapture(model, [2, 1])


def test_single_row_longer_than_budget_forms_its_own_batch():
    batches = make_batches(np.array([300, 20, 20]), 100)
    assert [(b.first, b.stop) for b in batches] == [(0, 1), (1, 3)]
