"""MTP head and the engine's `mtp` method: head math vs the HF layer, native weights (MiMo, Qwen3.5),
lossless T=0 decoding and the T>0 distribution."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.drafter.mtp import QWEN3_5_NAMES, MTPHead, load_mtp_head, native_mtp_format, trained_head_config  # noqa: E402
from draftforge.engine import generate, generate_ar, make_method, wrap_target  # noqa: E402
from engine_fixtures import (  # noqa: E402
    assert_matches_target_law,
    one_thread,  # noqa: F401  (autouse fixture)
    prompt,
    random_head,
    tiny_hybrid_target,
    tiny_target,
)


def hf_reference(head: MTPHead, hidden, embeds, positions):
    """The same step through the HF decoder layer's own forward (causal SDPA)."""
    x = head.inputs(hidden, embeds, positions)
    pe = head.rotary(x, positions)
    n = x.shape[1]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = head.layer(x, position_embeddings=pe, attention_mask=mask, position_ids=positions)
    out = out[0] if isinstance(out, tuple) else out
    return head.final_norm(out)


@pytest.mark.parametrize("hybrid", [False, True])
def test_head_matches_hf_layer_and_cache(hybrid):
    tm = tiny_hybrid_target() if hybrid else tiny_target()
    head = random_head(tm, seed=1)
    n, H = 9, tm.hidden_size
    g = torch.Generator().manual_seed(0)
    hidden, embeds = torch.randn(1, n, H, generator=g), torch.randn(1, n, H, generator=g)
    pos = torch.arange(n)[None]
    with torch.no_grad():
        full, _, _ = head(hidden, embeds, pos)
        ref = hf_reference(head, hidden, embeds, pos)
        torch.testing.assert_close(full, ref, atol=2e-5, rtol=1e-4)
        cache = head.new_cache()  # incremental: 4 + 1 + 4 rows through the cache
        parts = [head(hidden[:, a:b], embeds[:, a:b], pos[:, a:b], cache=cache)[0] for a, b in ((0, 4), (4, 5), (5, 9))]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)
    if not hybrid:  # MiMo: the token embedding at position 0 is masked out
        e2 = embeds.clone()
        e2[:, 0] += 1.0
        with torch.no_grad():
            torch.testing.assert_close(head(hidden, e2, pos)[0], full)


def _append_tensors(path: Path, extra: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file, save_file

    t = dict(load_file(str(path)))
    t.update({k: v.contiguous() for k, v in extra.items()})
    save_file(t, str(path), metadata={"format": "pt"})


def test_native_weights_mimo_and_qwen35(tmp_path):
    from draftforge.baselines.mtp_target import save_mtp_target
    from draftforge.target.config import RandomTargetConfig
    from draftforge.target.random import build_random_model

    mimo_dir = save_mtp_target(RandomTargetConfig(), tmp_path / "mimo", num_mtp_layers=1, predictable=False)
    assert native_mtp_format(mimo_dir) == "mimo"
    head = load_mtp_head(mimo_dir)
    from safetensors.torch import load_file

    raw = load_file(str(mimo_dir / "model.safetensors"))
    assert head.source == "native" and head.form == "mimo"
    torch.testing.assert_close(head.proj.weight, raw["model.mtp_layers.0.input_proj.weight"])
    torch.testing.assert_close(head.layer.self_attn.q_proj.bias, raw["model.mtp_layers.0.self_attn.q_proj.bias"])
    torch.testing.assert_close(head.enorm.weight, raw["model.mtp_layers.0.token_layernorm.weight"])

    spec = RandomTargetConfig(architecture="Qwen3_5ForCausalLM", vocab_size=96, hidden_size=64, intermediate_size=128,
                              num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, seed=2)
    model = build_random_model(spec)
    qdir = tmp_path / "qwen35"
    model.save_pretrained(qdir, safe_serialization=True)
    tm = wrap_target(model)
    src = random_head(tm, seed=3)
    named = {}
    for pname, t in src.state_dict().items():
        ours = next(o for o in QWEN3_5_NAMES if pname.startswith(o))
        named["mtp." + QWEN3_5_NAMES[ours] + pname[len(ours):]] = t
    _append_tensors(qdir / "model.safetensors", named)
    assert native_mtp_format(qdir) == "qwen3_5"
    head = load_mtp_head(qdir)
    assert head.form == "qwen3_5" and head.gated and head.qk_norm
    for k, v in src.state_dict().items():
        torch.testing.assert_close(head.state_dict()[k], v)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_lossless_greedy(hybrid, k):
    for seed in range(3):
        tm = tiny_hybrid_target(seed=seed) if hybrid else tiny_target(seed=seed)
        head = random_head(tm, seed=seed)
        head.num_drafts = k
        p = prompt(tm.vocab_size, 7 + seed, seed=seed)
        ref = generate_ar(tm, p, 24)
        res = generate(tm, make_method("mtp", tm, head), p, 24)
        assert res.tokens == ref.tokens, (seed, k)
        assert all(1 <= a <= k + 1 for a in res.accept_lengths)
        assert sum(res.accept_lengths) >= len(res.tokens) - 1


def test_mtp_accepts_on_a_copying_target():
    """A target whose greedy output is a fixed map of the current token and a head that reproduces
    it: every draft is accepted (τ = k + 1)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from draftforge.baselines.mtp_target import save_mtp_target
    from draftforge.target.config import RandomTargetConfig

    with tempfile.TemporaryDirectory() as d:
        tdir = save_mtp_target(RandomTargetConfig(), Path(d) / "t", predictable=True)
        model = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
        tm = wrap_target(model)
        head = load_mtp_head(tdir)
    head.num_drafts = 3
    res = generate(tm, make_method("mtp", tm, head), [5, 9, 11, 7], 33)
    assert res.tokens == generate_ar(tm, [5, 9, 11, 7], 33).tokens
    assert res.accept_lengths[:-1] == [4] * (len(res.accept_lengths) - 1)


def test_mtp_sampling_matches_target_distribution():
    """First 3 tokens at T=1 on a 4-token vocabulary (Qwen3 target + a trained-form head): Pearson
    chi-square vs the exact joint, α = 1e-3, with the negative control of the engine test."""
    from draftforge.target.config import RandomTargetConfig
    from draftforge.target.random import build_random_model

    spec = RandomTargetConfig(architecture="Qwen3ForCausalLM", vocab_size=4, hidden_size=32, intermediate_size=64,
                              num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, seed=3)
    model = build_random_model(spec)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.12)
    tm = wrap_target(model)
    head = random_head(tm, seed=1)
    head.num_drafts = 2
    p, n_tok, n = [0, 1, 2, 1, 3], 3, 1500
    gen = torch.Generator().manual_seed(1234)
    counts: Counter = Counter()
    accepted = 0
    for _ in range(n):
        res = generate(tm, make_method("mtp", tm, head), p, n_tok, temperature=1.0, generator=gen)
        counts[tuple(res.tokens)] += 1
        accepted += res.accept_lengths[0] >= 2
    assert accepted > n // 10, "drafts must be accepted often for this test to mean anything"

    assert_matches_target_law(counts, n, tm, p, n_tok, 1.0)


def test_recursive_training_rows_match_engine_drafting():
    """Training's depth-d row i equals the engine's recursive step (cache of pairs 0..i, then one
    entry per deeper depth)."""
    from draftforge.train.mtp import MTPSeq, recursive_outputs

    tm = tiny_target(seed=4)
    head = random_head(tm, seed=4)
    T, depth = 12, 3
    ids = torch.tensor(prompt(tm.vocab_size, T, seed=4))
    with torch.no_grad():
        h = tm.hf(ids[None], output_hidden_states=True).hidden_states[-1][0]  # final-normed
        outs = recursive_outputs(head, tm.embed.weight, MTPSeq(ids, torch.ones(T, dtype=torch.bool), h), depth)
        for i in (0, 4, 8):
            cache = head.new_cache()
            o, _, _ = head(h[None, : i + 1], tm.embed(ids[None, 1 : i + 2]), torch.arange(i + 1)[None], cache=cache)
            o = o[:, -1:]
            torch.testing.assert_close(o[0, 0], outs[0][i], atol=1e-5, rtol=1e-4)
            for d in range(2, depth + 1):
                o, _, _ = head(o, tm.embed(ids[None, i + d : i + d + 1]), torch.tensor([[i + d - 1]]), cache=cache)
                torch.testing.assert_close(o[0, 0], outs[d - 1][i], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("hybrid", [False, True])
def test_engine_mtp_chain_drafts_at_the_positions_training_uses(hybrid):
    """The engine's `mtp` method (MTPChain, not a re-statement of it) against training's `recursive_outputs` on the
    same sequence: the head's output at every depth of a round equals training's depth-d output of row start-1
    (whose teacher-forced tokens are the bonus and the engine's own drafts), so the drafts run at the positions
    and with the inputs the head was trained on. A depth fed one position late still decodes losslessly."""
    from draftforge.engine.methods import Features
    from draftforge.train.mtp import MTPSeq, recursive_outputs

    tm = tiny_hybrid_target(seed=6) if hybrid else tiny_target(seed=6)
    head = random_head(tm, seed=6)
    k = head.num_drafts = 4
    ids = prompt(tm.vocab_size, 14, seed=6)
    with torch.no_grad():
        h = tm.hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]  # final-normed
    for start in (5, 11):
        m = make_method("mtp", tm, head)
        m.begin(Features(None, h[None, :start], torch.tensor([ids[:start]])))
        seen: list[torch.Tensor] = []
        hook = head.final_norm.register_forward_hook(lambda mod, args, out, seen=seen: seen.append(out.detach()[0, -1].clone()))
        try:
            drafts = m.draft(ids[start], start)
        finally:
            hook.remove()
        assert len(seen) == k and len(drafts) == k
        seq = torch.tensor(ids[: start + 1] + drafts[:-1])  # x_0..x_start (the bonus), then drafts 1..k-1
        hidden = torch.cat([h[:start], torch.zeros(seq.numel() - start, h.shape[1])])  # rows >= start: unused by row start-1
        with torch.no_grad():
            outs = recursive_outputs(head, tm.embed.weight, MTPSeq(seq, torch.ones(seq.numel(), dtype=torch.bool), hidden), k)
        for d in range(k):
            torch.testing.assert_close(seen[d], outs[d][start - 1], atol=2e-5, rtol=1e-4, msg=f"start {start}, depth {d + 1}")
            assert drafts[d] == int(tm.lm_head(outs[d][start - 1]).argmax()), (start, d + 1)


def test_mtp_training_loss_decreases():
    """A trained head on a tiny target: training loss falls; simulated τ on seen sequences rises above 1."""
    from draftforge.train.config import TrainConfig
    from draftforge.train.head import FrozenTargetHead
    from draftforge.train.mtp import MTPInputs, train_mtp

    tm = tiny_target(seed=5, vocab=64)
    head = MTPHead(trained_head_config(tm.hf.config.to_dict()), "mimo", "trained")
    items, grab = [], {}
    # extract's `last_hidden`: the target's final norm output
    hook = tm.hf.model.norm.register_forward_hook(lambda m, a, o: grab.update(h=o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        for s in range(12):  # greedy continuations: predictable text the head can learn
            p = prompt(tm.vocab_size, 4, seed=s)
            ids = torch.tensor(p + generate_ar(tm, p, 28).tokens)
            tm.hf(ids[None])
            items.append((ids, torch.ones(ids.numel(), dtype=torch.uint8), None, grab["h"][0]))  # (ids, mask, taps, last)
    hook.remove()
    from draftforge.train.data import InMemorySource

    frozen = FrozenTargetHead(tm.embed.weight.detach().clone(), tm.lm_head.weight.detach().clone())
    cfg = TrainConfig(mtp_steps=60, mtp_lr=3e-3, mtp_depth=2, mtp_rows=64, mtp_val_drafts=3, mtp_eval_every=30,
                      max_seq_len=64, val_max_seqs=2)
    res = train_mtp(MTPInputs(cfg, head, frozen, InMemorySource(items[:10]), InMemorySource(items[:2])))
    first, last = sum(r["mtp_loss"] for r in res.history[:5]) / 5, sum(r["mtp_loss"] for r in res.history[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert res.best is not None and res.best["val_mtp_sim_tau"] > 1.3, res.evals


def test_export_for_a_tied_target_round_trips(tmp_path):
    """A trained head exported for a target with tied embeddings (one stored table, as SmolLM2):
    the MiMo export holds separate embedding and LM-head copies and loads back unchanged."""
    from draftforge.drafter.mtp import export_mimo_head, new_trained_head
    from draftforge.target.config import RandomTargetConfig
    from draftforge.target.random import save_random_target

    spec = RandomTargetConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    tdir = save_random_target(spec, tmp_path / "tied")
    head, copied = new_trained_head(tdir)
    assert copied == 1
    out = export_mimo_head(head, tmp_path / "mtp", tdir, dtype=torch.float32)
    back = load_mtp_head(out)
    assert back.source == "trained"
    for k, v in head.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v)


def test_a_truncated_head_export_is_one_error_naming_the_file(tmp_path):
    """The MTP head loader (lazy safetensors reads) names a truncated model.safetensors in one StageError."""
    from draftforge.drafter.mtp import export_mimo_head, new_trained_head
    from draftforge.errors import StageError
    from draftforge.target.config import RandomTargetConfig
    from draftforge.target.random import save_random_target

    spec = RandomTargetConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16)
    tdir = save_random_target(spec, tmp_path / "target")
    out = export_mimo_head(new_trained_head(tdir)[0], tmp_path / "mtp", tdir, dtype=torch.float32)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(StageError, match=rf"{weights}: not a readable safetensors file \(.*\); it is truncated") as err:
        load_mtp_head(out)
    assert "\n" not in str(err.value)
