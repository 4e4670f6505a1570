"""Engine: target wrapper vs HF, KV cache ops, lossless T=0 decoding, T>0 distribution, compaction."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.engine import generate, generate_ar, generate_ddtree, generate_dflash, sample, wrap_target  # noqa: E402
from draftforge.engine.loops import verify_round  # noqa: E402
from draftforge.engine.methods import Features, make_method  # noqa: E402
from draftforge.engine.span import chain_span  # noqa: E402
from draftforge.engine.state import CapacityError, TargetState  # noqa: E402
from draftforge.engine.target import forward  # noqa: E402
from draftforge.engine.timing import StageTimer  # noqa: E402
from draftforge.target.config import RandomTargetConfig  # noqa: E402
from draftforge.target.random import build_random_model  # noqa: E402
from engine_fixtures import (  # noqa: E402
    ARCHS,
    assert_matches_target_law,
    one_thread,  # noqa: F401  (autouse fixture)
    prompt,
    tiny_drafter,
    tiny_target,
)


@pytest.mark.parametrize("arch", ARCHS)
def test_wrapper_matches_hf_logits_and_taps(arch):
    tm = tiny_target(arch, seed=1, taps=(0, 2))
    ids = torch.tensor([prompt(tm.vocab_size, 9)])
    ref = tm.hf(ids, output_hidden_states=True)
    state = TargetState(tm, 9)
    h1, t1 = forward(tm, state, chain_span(ids[:, :5], 0, tm.dtype, True), True)
    h2, t2 = forward(tm, state, chain_span(ids[:, 5:], 5, tm.dtype, True), True)
    assert state.length == 9
    torch.testing.assert_close(tm.lm_head(torch.cat([h1, h2], 1)), ref.logits, atol=1e-4, rtol=1e-4)
    hs = ref.hidden_states  # layer id L = output of decoder layer L = hidden_states[L + 1]
    torch.testing.assert_close(torch.cat([t1, t2], 1), torch.cat([hs[1], hs[3]], -1), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_ar_equals_hf_greedy_generate(arch):
    tm = tiny_target(arch, seed=2)
    p = prompt(tm.vocab_size, 6, seed=2)
    res = generate_ar(tm, p, 24)
    ref = tm.hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert res.tokens == ref[0, len(p):].tolist()
    assert res.accept_lengths == [1] * 23 and res.tau == 1.0
    assert res.ttft_s > 0 and res.decode_s > 0 and res.n_decode == 23


def test_state_commit_compacts_path_rows_and_refuses_overflow():
    tm = tiny_target(seed=0)
    state = TargetState(tm, 12)
    forward(tm, state, chain_span(torch.tensor([prompt(tm.vocab_size, 3)]), 0, tm.dtype, True))
    forward(tm, state, chain_span(torch.tensor([prompt(tm.vocab_size, 5, seed=1)]), 3, tm.dtype, False))
    assert state.length == 3 and state.pending == 5
    before = state.kv.clone()
    state.commit(torch.tensor([0, 2, 3]))
    assert state.length == 6
    torch.testing.assert_close(state.kv[..., :3, :], before[..., :3, :])
    torch.testing.assert_close(state.kv[..., 3:6, :], before[..., [3, 5, 6], :])
    state.crop(2)
    assert state.length == 2
    with pytest.raises(ValueError):
        state.crop(3)
    with pytest.raises(CapacityError, match="capacity of 12"):
        forward(tm, state, chain_span(torch.tensor([prompt(tm.vocab_size, 11)]), 2, tm.dtype, True))


def test_sample_rule():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    assert sample(logits, 0.0).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, 1.0, g) for _ in range(2000)])  # (2000, 2)
    p = torch.softmax(logits[0], -1)
    freq = torch.bincount(draws[:, 0], minlength=3).float() / 2000
    assert (freq - p).abs().max() < 0.04


# --------------------------------------------------------------------------------- lossless at T = 0
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lossless_greedy_random_vocab(arch, seed):
    """DFlash chain and DDTree (budgets 1…1024) produce exactly AR's tokens (fp32 CPU)."""
    tm = tiny_target(arch, vocab=96, seed=seed)
    drafter = tiny_drafter(tm, seed=seed)
    p = prompt(tm.vocab_size, 7, seed=seed)
    ar = generate_ar(tm, p, 40)
    assert generate_dflash(tm, drafter, p, 40).tokens == ar.tokens
    for budget in (1, 3, 32, 1024):
        res = generate_ddtree(tm, drafter, p, 40, budget=budget)
        assert res.tokens == ar.tokens, f"budget {budget}"
        assert sum(res.accept_lengths) >= len(ar.tokens) - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_lossless_greedy_small_vocab_deep_acceptance(arch):
    """Vocabulary 8: trees cover several depths, so paths of 3+ nodes are accepted and compacted."""
    tm = tiny_target(arch, vocab=8, seed=4)
    drafter = tiny_drafter(tm, seed=4, block=8)
    p = [5, 1, 2, 7, 4, 6]
    ar = generate_ar(tm, p, 60)
    dflash = generate_dflash(tm, drafter, p, 60)
    assert dflash.tokens == ar.tokens
    for budget in (1, 8, 64, 1024):
        res = generate_ddtree(tm, drafter, p, 60, budget=budget)
        assert res.tokens == ar.tokens, f"budget {budget}"
    assert max(res.accept_lengths) >= 4  # budget 1024 spans the first depths fully
    assert res.tau > dflash.tau


def test_eos_stops_every_method_at_the_same_token():
    tm = tiny_target(vocab=96, seed=5)
    drafter = tiny_drafter(tm, seed=5)
    p = prompt(96, 7, seed=5)
    full = generate_ar(tm, p, 30).tokens
    eos = full[12]
    cut = full[: full.index(eos) + 1]
    assert generate_ar(tm, p, 30, eos_ids=[eos]).tokens == cut
    assert generate_dflash(tm, drafter, p, 30, eos_ids=[eos]).tokens == cut
    assert generate_ddtree(tm, drafter, p, 30, budget=64, eos_ids=[eos]).tokens == cut


def test_round_stats_are_recorded():
    tm = tiny_target(vocab=8, seed=4)
    drafter = tiny_drafter(tm, seed=4, block=8)
    res = generate_ddtree(tm, drafter, [5, 1, 2, 7], 30, budget=64)
    rounds = len(res.accept_lengths)
    assert rounds >= 1 and all(1 <= a <= 8 for a in res.accept_lengths)
    assert len(res.stage_s["verify"]) == len(res.stage_s["build"]) == len(res.stage_s["commit"]) == rounds
    assert len(res.stage_s["draft"]) == rounds - 1  # round 1 reuses the draft's context-prefill pass
    assert res.draft_prefill_s > 0 and res.tokens_per_s > 0 and res.tpot_s > 0


# --------------------------------------------------------------------------------- KV compaction
@pytest.mark.parametrize("arch", ARCHS)
def test_compaction_equals_recomputing_the_accepted_path(arch):
    for seed in range(6, 30):  # first (deterministic) seed whose round accepts a multi-node path
        tm = tiny_target(arch, vocab=8, seed=seed)
        drafter = tiny_drafter(tm, seed=seed, block=6)
        p = [4, 2, 6, 1, 7]
        state = TargetState(tm, 256)
        h, taps = forward(tm, state, chain_span(torch.tensor([p]), 0, tm.dtype, True), True)
        bonus = int(tm.lm_head(h[0, -1]).argmax())
        method = make_method("ddtree", tm, drafter, 200)
        method.begin(Features(taps, h))
        drafted = method.draft(bonus, len(p))
        rnd = verify_round(tm, state, method, drafted, bonus, 0.0, None, StageTimer("cpu", ("build", "verify", "commit")))
        committed, new_bonus = rnd.committed, rnd.bonus
        if len(committed) >= 3:
            break
    assert len(committed) >= 3, "want a multi-node accepted path"
    ref = TargetState(tm, 64)
    seq = p + committed
    _, ref_taps = forward(tm, ref, chain_span(torch.tensor([seq]), 0, tm.dtype, True), True)
    assert state.length == ref.length == len(seq)
    torch.testing.assert_close(state.kv[..., : len(seq), :], ref.kv[..., : len(seq), :], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(method.ctx.pending, ref_taps[:, len(p):], atol=2e-4, rtol=2e-4)  # new draft context
    h_next, _ = forward(tm, state, chain_span(torch.tensor([[new_bonus]]), len(seq), tm.dtype, True))
    h_ref, _ = forward(tm, ref, chain_span(torch.tensor([[new_bonus]]), len(seq), tm.dtype, True))
    torch.testing.assert_close(h_next, h_ref, atol=2e-4, rtol=2e-4)


# --------------------------------------------------------------------------------- T > 0 distribution
@pytest.mark.parametrize(
    "method,temperature,arch",
    [
        ("ddtree", 1.0, "Qwen3ForCausalLM"),
        ("ddtree", 1.0, "Qwen3_5ForCausalLM"),  # hybrid: tree verification through GDN layers
        ("ddtree_lookup", 1.0, "Qwen3ForCausalLM"),  # the prompt-lookup branch: a 4-token vocabulary repeats
        pytest.param("ddtree", 0.7, "Qwen3ForCausalLM", marks=pytest.mark.integration),  # slower variants
        pytest.param("dflash", 1.0, "Qwen3ForCausalLM", marks=pytest.mark.integration),
    ],
)
def test_sampling_matches_target_distribution(method, temperature, arch):
    """First 3 tokens at T>0 on a 4-token vocabulary: Pearson chi-square vs the exact joint (64 cells).

    Tolerance: reject at α = 1e-3 (z = 3.09, Wilson–Hilferty critical value); seeded, so the test is
    deterministic. A negative control (the same samples against the T=0.4 joint) must be rejected.
    """
    hybrid = arch == "Qwen3_5ForCausalLM"  # 2 GDN layers + 1 attention layer
    spec = RandomTargetConfig(architecture=arch, vocab_size=4, hidden_size=32, intermediate_size=64,
                              num_layers=3 if hybrid else 2, num_heads=2, num_kv_heads=1, head_dim=16, seed=3,
                              full_attention_interval=3, linear_num_key_heads=1, linear_num_value_heads=2,
                              linear_key_head_dim=8, linear_value_head_dim=8)
    model = build_random_model(spec)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.12)  # flatter next-token distributions than the default init
    tm = wrap_target(model, (0,))
    drafter = tiny_drafter(tm, seed=1, block=4)
    p, n_tok, n = [0, 1, 2, 1, 3], 3, 2000
    gen = torch.Generator().manual_seed(1234)
    counts: Counter = Counter()
    accepted_deep = 0
    for _ in range(n):
        if method in ("ddtree", "ddtree_lookup"):
            res = generate(tm, make_method(method, tm, drafter, 12), p, n_tok, temperature=temperature, generator=gen)
        else:
            res = generate_dflash(tm, drafter, p, n_tok, temperature=temperature, generator=gen)
        counts[tuple(res.tokens)] += 1
        accepted_deep += res.accept_lengths[0] >= 2
    assert accepted_deep > n // 10, "the tree must accept drafted nodes often for this test to mean anything"

    assert_matches_target_law(counts, n, tm, p, n_tok, temperature)
