"""Split-KV attention (engine/split_attention.py) equals the folded SDPA it replaces on small spans: the
Triton kernel runs on CPU under TRITON_INTERPRET=1 (in a subprocess: the flag is read when Triton loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import torch
from draftforge.engine.split_attention import combine_splits, plan, split_partials
from draftforge.engine.blocks import attend

torch.manual_seed(0)
# (Hq, Hkv, n, hd, capacity, kv_len): AR step, a chain, a tree over several query tiles, one split only,
# a wide head (Qwen3.5/3.6's 256: smaller tiles)
for hq, hkv, n, hd, cap, kv_len in [(4, 2, 1, 64, 192, 37), (8, 2, 5, 32, 256, 200), (4, 1, 40, 32, 320, 90),
                                    (6, 3, 17, 16, 64, 60), (6, 1, 9, 256, 160, 120)]:
    g, past = hq // hkv, kv_len - n
    q, k, v = torch.randn(1, hq, n, hd), torch.randn(hkv, cap, hd), torch.randn(hkv, cap, hd)
    k[:, kv_len:] = float("nan")  # rows past kv_len must never be read (NaN would poison the output)
    vis = torch.zeros(n, cap, dtype=torch.bool)
    vis[:, :past] = True
    vis[:, past:kv_len] = torch.tril(torch.rand(n, n) < 0.5) | torch.eye(n, dtype=torch.bool)  # a random tree
    mask = torch.zeros(n, cap).masked_fill(~vis, float("-inf")).repeat(g, 1)[None, None]
    ref = attend(q, k[None].clone().masked_fill(~vis.any(0)[None, None, :, None], 0), v[None], mask, False, 0.3)
    out = combine_splits(*split_partials(q, k, v, mask, torch.tensor([kv_len]), 0.3), n, q.dtype)
    splits, chunk = plan(cap, hkv, g * n, hd)
    assert splits * chunk >= cap and chunk % (64 if hd <= 128 else 32) == 0
    err = (out - ref).abs().max().item()
    assert err < 1e-5, (hq, hkv, n, err)
print("ok")
"""


def test_split_kv_attention_equals_sdpa_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


ENGINE = r"""
import sys
sys.path.insert(0, "tests")
import torch
from draftforge.engine import generate, make_method, split_attention
from draftforge.engine.graph import CapturedEngine, verify_buckets
from engine_fixtures import prompt, tiny_drafter, tiny_hybrid_target, tiny_target

split_attention.usable = lambda q, rows, n_kv: True  # CPU tensors: the kernel runs in the interpreter
for arch in ("Qwen3ForCausalLM", "Qwen3_5ForCausalLM"):
    tm = (tiny_hybrid_target if arch.startswith("Qwen3_5") else tiny_target)(arch, seed=4)
    d = tiny_drafter(tm, seed=4)
    p = prompt(tm.vocab_size, 20, seed=2)
    ar = generate(tm, None, p, 16).tokens
    eng = CapturedEngine(tm, 128, verify_buckets([d.cfg.block_size, 17]), drafter=d, fused=True, split_attention=True)
    assert generate(tm, None, p, 16, engine=eng).tokens == ar, arch
    for name, b in (("dflash", None), ("ddtree", 16)):
        eager = generate(tm, make_method(name, tm, d, b), p, 16)
        split = generate(tm, make_method(name, tm, d, b), p, 16, engine=eng)
        assert split.tokens == eager.tokens == ar and split.accept_lengths == eager.accept_lengths, (arch, name)
print("ok")
"""


def test_engine_with_split_attention_gives_the_eager_tokens():
    """The fused static step with split-KV attention (kv_len from the span's slots, partials merged in the
    post-attention block) decodes AR, DFlash and DDTree exactly as the eager engine."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ENGINE], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
