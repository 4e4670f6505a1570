"""Native MTP layers applied as the architecture defines: on a tiny MiMo target whose MTP layer is
right about half the time, the standalone engine's `mtp` τ matches vLLM's (`method: mtp`, the target's
own layer) on the same prompts within 5%, and both reproduce greedy AR."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
PROMPTS = [[5, 9, 11, 7], [40, 41, 42, 43, 44], [100, 3, 77]]
N_GEN, K, SIGMA = 48, 2, 0.03


def noisy_mimo_target(out: Path) -> Path:
    """The predictable MiMo target (exact MTP layer) with noise on the MTP input projection."""
    from safetensors.torch import load_file, save_file

    from draftforge.baselines.mtp_target import save_mtp_target
    from draftforge.target.config import RandomTargetConfig

    d = save_mtp_target(RandomTargetConfig(), out, predictable=True)
    t = dict(load_file(str(d / "model.safetensors")))
    w = t["model.mtp_layers.0.input_proj.weight"]
    t["model.mtp_layers.0.input_proj.weight"] = w + SIGMA * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_native_mimo_mtp_tau_matches_vllm(tmp_path):
    from transformers import AutoModelForCausalLM

    from draftforge.drafter.mtp import load_mtp_head
    from draftforge.engine import generate, generate_ar, make_method, wrap_target

    d = noisy_mimo_target(tmp_path / "mimo")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tm = wrap_target(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval())
        head = load_mtp_head(d)
        head.num_drafts = K
        ours = [generate(tm, make_method("mtp", tm, head), p, N_GEN) for p in PROMPTS]
        ar = [generate_ar(tm, p, N_GEN).tokens for p in PROMPTS]
    finally:
        torch.set_num_threads(threads)
    assert head.source == "native" and [r.tokens for r in ours] == ar
    accepts = [a for r in ours for a in r.accept_lengths]
    our_tau = sum(accepts) / len(accepts)
    assert 1.2 < our_tau < 1 + K - 0.2, our_tau  # partly right: the comparison means something

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(d), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=256,
              max_num_seqs=1, enable_prefix_caching=False, skip_tokenizer_init=True, disable_log_stats=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": K})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=N_GEN, ignore_eos=True, detokenize=False))
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    finally:
        llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
        del llm
    assert [list(o.outputs[0].token_ids) for o in outs] == ar
    vllm_tau = 1 + counters["vllm:spec_decode_num_accepted_tokens"] / counters["vllm:spec_decode_num_drafts"]
    print(f"native MiMo MTP k={K}: standalone tau {our_tau:.3f}, vLLM tau {vllm_tau:.3f}")
    assert abs(vllm_tau - our_tau) <= 0.05 * our_tau, (our_tau, vllm_tau)
