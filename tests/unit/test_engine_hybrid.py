"""Hybrid Gated-DeltaNet targets (Qwen3.5 text, Qwen3-Next): the engine against transformers' own model.

Reference semantics are HF's forward (its chunked gated delta rule and causal conv); the engine's tree
form must give every tree node the logits of an HF forward over that node's root path, and after a
commit the recurrent and conv states of HF's cache after the accepted tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.engine import generate_ar, generate_ddtree, generate_dflash  # noqa: E402
from draftforge.engine.gdn import PREFILL_CHUNK, delta_rule_tree, state_after  # noqa: E402
from draftforge.engine.span import chain_span, tree_span  # noqa: E402
from draftforge.engine.state import TargetState  # noqa: E402
from draftforge.engine.target import forward  # noqa: E402
from draftforge.engine.tree import build_tree, draft_topk  # noqa: E402
from engine_fixtures import (  # noqa: E402
    HYBRID_ARCHS,
    one_thread,  # noqa: F401  (autouse fixture)
    prompt,
    tiny_drafter,
    tiny_hybrid_target,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-9)).item()


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_prefill_in_spans_matches_hf_logits_and_taps(arch):
    """A prompt longer than the prefill chunk, fed as two spans, equals one HF forward."""
    tm = tiny_hybrid_target(arch, seed=1)
    n = PREFILL_CHUNK + 30
    ids = torch.tensor([prompt(tm.vocab_size, n, seed=1)])
    ref = tm.hf(ids, output_hidden_states=True)
    state = TargetState(tm, n)
    h1, t1 = forward(tm, state, chain_span(ids[:, :70], 0, tm.dtype, True), True)
    h2, t2 = forward(tm, state, chain_span(ids[:, 70:], 70, tm.dtype, True), True)
    assert _rel(tm.lm_head(torch.cat([h1, h2], 1)), ref.logits) < 1e-4
    hs = ref.hidden_states
    assert _rel(torch.cat([t1, t2], 1), torch.cat([hs[2], hs[4], hs[6]], -1)) < 1e-4


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_ar_equals_hf_greedy_generate(arch):
    tm = tiny_hybrid_target(arch, seed=2)
    p = prompt(tm.vocab_size, PREFILL_CHUNK + 5, seed=2)
    res = generate_ar(tm, p, 24)
    ref = tm.hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert res.tokens == ref[0, len(p):].tolist()


@pytest.mark.parametrize("seed", range(4))
def test_tree_delta_rule_equals_per_path_recurrence_fp64(seed):
    """The WY tree form against the token-by-token recurrence along every node's root path (fp64)."""
    g = torch.Generator().manual_seed(seed)
    n, Hv, dk, dv = 60, 3, 8, 5
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]  # random topological tree
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    q = torch.nn.functional.normalize(torch.randn(Hv, n, dk, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(Hv, n, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(Hv, n, dv, generator=g, dtype=torch.float64)
    gate = -torch.rand(Hv, n, generator=g, dtype=torch.float64)
    beta = torch.rand(Hv, n, generator=g, dtype=torch.float64)
    S0 = torch.randn(Hv, dk, dv, generator=g, dtype=torch.float64)
    out, G, delta = delta_rule_tree(q, k, v, gate, beta, S0, anc)
    for i in range(n):
        path = anc[i].nonzero().squeeze(-1).tolist()  # ascending = root to i
        S = S0.clone()
        for t in path:  # S ← e^g S; Δ = β (v − Sᵀk); S ← S + k Δᵀ
            S = S * gate[:, t].exp()[:, None, None]
            d = beta[:, t, None] * (v[:, t] - torch.einsum("hkv,hk->hv", S, k[:, t]))
            S = S + k[:, t, :, None] * d[:, None, :]
        torch.testing.assert_close(out[:, i], torch.einsum("hkv,hk->hv", S, q[:, i]), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state_after(S0, G, k, delta, torch.tensor(path)), S, rtol=1e-10, atol=1e-10)


def _hf_state(tm, seq: list[int]):
    """HF's cache after `seq`: per GDN layer (recurrent (Hv, dk, dv), last K−1 conv inputs (K−1, C))."""
    out = tm.hf(torch.tensor([seq]), use_cache=True)
    cache = out.past_key_values
    rec, conv = [], []
    for i, kind in enumerate(tm.kinds):
        if kind == "gdn":
            layer = cache.layers[i]
            rec.append(layer.recurrent_states[0][0])
            conv.append(layer.conv_states[0][0, :, 1:].T)
    return out.logits[0, -1], rec, conv


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_every_tree_node_matches_hf_on_its_root_path_and_commit_matches_hf_state(arch, seed):
    """fp32. The first GDN layer sees exact inputs (≤ 1e-5); deeper ones inherit the rounding of the layers
    above, amplified by the random model's large init (≤ 1e-4). Exactness itself: the fp64 test above."""
    tm = tiny_hybrid_target(arch, vocab=24, seed=seed)
    p = prompt(tm.vocab_size, 9, seed=seed)
    g = torch.Generator().manual_seed(seed)
    logp, toks = draft_topk(torch.randn(6, tm.vocab_size, generator=g) * 3, 24)
    tree = build_tree(5, logp, toks, budget=40)  # random tree: 40 nodes over 6 depths
    state = TargetState(tm, 64)
    forward(tm, state, chain_span(torch.tensor([p]), 0, tm.dtype, True))
    h, _ = forward(tm, state, tree_span(tree, len(p), tm.device, tm.dtype, tm.conv_kernel))
    logits = tm.lm_head(h[0])  # (1+N, V)

    def root_path(i: int) -> list[int]:
        path = []
        while i >= 0:
            path.append(i)
            i = tree.parents[i]
        return path[::-1]

    for i in range(len(tree)):
        seq = p + [tree.tokens[j] for j in root_path(i)]
        ref = tm.hf(torch.tensor([seq])).logits[0, -1]
        assert _rel(logits[i], ref) < 1e-4, f"node {i} (depth {tree.depths[i]})"
    deepest = max(range(len(tree)), key=lambda i: (tree.depths[i], -i))
    path = root_path(deepest)
    assert len(path) >= 4
    state.commit(torch.tensor(path))
    _, rec, conv = _hf_state(tm, p + [tree.tokens[j] for j in path])
    for s in range(len(rec)):
        tol = 1e-5 if s == 0 else 1e-4
        assert _rel(state.rec[s], rec[s]) < tol, f"recurrent state, GDN layer {s}"
        assert _rel(state.conv[s], conv[s]) < tol, f"conv state, GDN layer {s}"


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_lossless_greedy(arch, seed):
    """DFlash and DDTree (budgets 1…256) == AR, prompts crossing the prefill chunk."""
    tm = tiny_hybrid_target(arch, vocab=32, seed=seed)
    drafter = tiny_drafter(tm, seed=seed, block=6)
    p = prompt(tm.vocab_size, PREFILL_CHUNK + 3 + seed, seed=seed)
    ar = generate_ar(tm, p, 30)
    assert generate_dflash(tm, drafter, p, 30).tokens == ar.tokens
    for budget in (1, 4, 16, 64, 256):
        res = generate_ddtree(tm, drafter, p, 30, budget=budget)
        assert res.tokens == ar.tokens, f"budget {budget}"


def test_small_vocab_accepts_deep_paths_and_stays_lossless():
    """Vocabulary 8: trees cover the first depths, so multi-node paths are committed through GDN layers."""
    tm = tiny_hybrid_target(vocab=8, seed=4)
    drafter = tiny_drafter(tm, seed=4, block=8)
    p = [5, 1, 2, 7, 4, 6]
    ar = generate_ar(tm, p, 60)
    for budget in (8, 64, 256):
        res = generate_ddtree(tm, drafter, p, 60, budget=budget)
        assert res.tokens == ar.tokens, f"budget {budget}"
    assert max(res.accept_lengths) >= 4
