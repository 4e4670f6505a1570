"""A target wrapped on the CPU in fp32 (q/k/v and gate/up fused, engine/fused.py) and moved afterwards: the eager
engine follows the model's new placement and weights, never a fused copy made for the old one."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.engine import generate_ar  # noqa: E402
from draftforge.engine.span import chain_span  # noqa: E402
from draftforge.engine.state import TargetState  # noqa: E402
from draftforge.engine.target import eager_runtime, forward  # noqa: E402
from engine_fixtures import prompt, tiny_hybrid_target, tiny_target  # noqa: E402


def _engine_logits(tm, ids: list[int]) -> torch.Tensor:
    state = TargetState(tm, 64)
    with torch.no_grad():
        h, _ = forward(tm, state, chain_span(torch.tensor([ids]), 0, tm.dtype, True))
        return tm.lm_head(h[0])  # (n, V)


def _hf_logits(tm, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tm.hf(torch.tensor([ids])).logits[0]  # (n, V)


def _max_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


def test_eager_engine_follows_a_dtype_move_and_refuses_stale_fused_weights() -> None:
    for tm in (tiny_target(seed=3), tiny_hybrid_target(seed=3)):
        fused_fp32 = [fl.wqkv for fl in eager_runtime(tm).fused if fl.wqkv is not None]
        assert fused_fp32 and all(w.dtype == torch.float32 for w in fused_fp32)  # the CPU fp32 runtime fuses
        p = prompt(tm.vocab_size, 11, seed=3)

        tm.hf.to(torch.float64)  # every Linear gets a new tensor; the fp32 fused copies are now stale
        assert all(fl.wqkv is None for fl in eager_runtime(tm).fused)  # off CPU fp32: the HF projections
        assert _max_rel_err(_engine_logits(tm, p), _hf_logits(tm, p)) < 1e-4  # HF's GDN reference kernels: fp32 inside

        tm.hf.to(torch.float32)  # back: fused again from the Linears' current tensors, not the cached copies
        fused = [fl.wqkv for fl in eager_runtime(tm).fused if fl.wqkv is not None]
        assert all(w is not old for w, old in zip(fused, fused_fp32))
        attn = next(layer.self_attn for layer, k in zip(tm.layers, tm.kinds) if k == "attention")
        with torch.no_grad():
            attn.q_proj.weight.mul_(-1.5)  # in place: reaches the fused tensor through its view
        assert _max_rel_err(_engine_logits(tm, p), _hf_logits(tm, p)) < 1e-4
        ar = generate_ar(tm, p, 12).tokens
        ref = tm.hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        assert ref and ar[: len(ref)] == ref  # HF's generate stops at its EOS; ours runs to 12


def test_static_engine_fuses_again_after_the_target_and_drafter_moved() -> None:
    """The GPU tests' order, on the CPU: fuse (a static engine with fused weights), move both models, build
    another static engine: it must fuse the moved weights, not reuse the first engine's fp32 copies."""
    from draftforge.engine import generate, make_method
    from draftforge.engine.graph import CapturedEngine, verify_buckets
    from engine_fixtures import tiny_drafter

    tm = tiny_target("Qwen3ForCausalLM", vocab=16, seed=3)  # small vocab: drafts get accepted
    d = tiny_drafter(tm, seed=3)
    buckets = verify_buckets([d.cfg.block_size, 5])
    CapturedEngine(tm, 128, buckets, drafter=d, fused=True)  # fuses target and drafter in fp32
    tm.hf.to(torch.float64)
    d.to(torch.float64)
    eng = CapturedEngine(tm, 128, buckets, drafter=d, fused=True)
    assert all(fl.wqkv is None or fl.wqkv.dtype == torch.float64 for fl in eng.runtime.fused)
    p = prompt(tm.vocab_size, 9, seed=0)
    ar = generate(tm, None, p, 16).tokens
    assert generate(tm, None, p, 16, engine=eng).tokens == ar
    for name, b in (("dflash", None), ("ddtree", 4)):
        assert generate(tm, make_method(name, tm, d, b), p, 16, engine=eng).tokens == ar, name
