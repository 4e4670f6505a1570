"""The captured engine on CUDA (skipped without a GPU): CUDA-graph replays give the eager engine's
tokens (fp32: identical; bf16: differences counted), and size errors are raised before any replay."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from draftforge.drafter.registry import tree_methods  # noqa: E402  (torch-free)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BUDGETS = (1, 16, 64, 256)


def _setup(arch: str, dtype: torch.dtype, seed: int = 0, variant: str = "graphs"):
    from draftforge.engine.graph import CapturedEngine, verify_buckets
    from engine_fixtures import tiny_drafter, tiny_hybrid_target, tiny_target

    hybrid = arch.startswith(("Qwen3_5", "Qwen3Next"))
    tm = (tiny_hybrid_target if hybrid else tiny_target)(arch, seed=seed)
    tm.hf.to("cuda", dtype)
    d = tiny_drafter(tm, seed=seed).to("cuda", dtype)
    eng = CapturedEngine(tm, 512, verify_buckets([d.cfg.block_size] + [b + 1 for b in BUDGETS]), drafter=d,
                         compile=variant.startswith("compiled"), split_attention=variant == "compiled_split")
    eng.capture()
    assert eng.graphs and all(b.graph is not None for b in eng._buckets.values()) and eng.drafter.graph is not None
    return tm, d, eng


@pytest.mark.parametrize("variant", ["graphs", "compiled", "compiled_split"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_captured_equals_eager_fp32(arch: str, variant: str) -> None:
    from draftforge.engine import generate, make_method
    from engine_fixtures import prompt

    tm, d, eng = _setup(arch, torch.float32, variant=variant)
    for seed, plen in ((0, 9), (1, 70)):
        p = prompt(tm.vocab_size, plen, seed=seed)
        ar = generate(tm, None, p, 40).tokens
        assert generate(tm, None, p, 40, engine=eng).tokens == ar, "ar"
        for name, b in [("dflash", None)] + [("ddtree", b) for b in BUDGETS]:
            eager = generate(tm, make_method(name, tm, d, b), p, 40)
            cap = generate(tm, make_method(name, tm, d, b), p, 40, engine=eng)
            assert cap.tokens == eager.tokens == ar, (name, b, seed)
            assert cap.accept_lengths == eager.accept_lengths, (name, b, seed)


@pytest.mark.parametrize("kind", ["dflash", "dflash_sliding", "dflash_draft_vocab", "dspark", "dspark_bonus_anchor",
                                  "dspark_draft_vocab", "mtp"])
@pytest.mark.parametrize("variant", ["graphs", "compiled"])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_captured_equals_eager_every_method_and_drafter_type_fp32(arch: str, variant: str, kind: str) -> None:
    """CUDA graphs (and compiled blocks) == the eager engine in fp32, tokens and accept lengths, for every
    registered method × drafter type (the CPU twin: tests/unit/test_engine_graph.py)."""
    from draftforge.engine import generate, make_method
    from draftforge.engine.graph import CapturedEngine, verify_buckets
    from engine_fixtures import drafter_kinds, prompt, tiny_hybrid_target, tiny_target

    tm = (tiny_hybrid_target if arch.startswith("Qwen3_5") else tiny_target)(arch, vocab=16, seed=3)
    build, names = drafter_kinds()[kind]
    d = build(tm)
    tm.hf.to("cuda", torch.float32)
    d = d.to("cuda", torch.float32)
    plan = [(m, b) for m in names for b in ((1, 16) if m in tree_methods() else (None,))]
    sizes = [make_method(m, tm, d, b).verify_size for m, b in plan]
    eng = CapturedEngine(tm, 256, verify_buckets(sizes), drafter=None if kind == "mtp" else d,
                         compile=variant == "compiled")
    eng.capture()
    for seed, plen in ((0, 9), (1, 70)):
        p = prompt(tm.vocab_size, plen, seed=seed)
        ar = generate(tm, None, p, 32).tokens
        assert generate(tm, None, p, 32, engine=eng).tokens == ar, "ar"
        for name, b in plan:
            eager = generate(tm, make_method(name, tm, d, b), p, 32)
            cap = generate(tm, make_method(name, tm, d, b), p, 32, engine=eng)
            assert cap.tokens == eager.tokens == ar, (name, b, seed)
            assert cap.accept_lengths == eager.accept_lengths, (name, b, seed)


@pytest.mark.parametrize("variant", ["graphs", "compiled", "compiled_split"])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3_5ForCausalLM"])
def test_captured_bf16_differences_are_rare_and_counted(arch: str, variant: str) -> None:
    from draftforge.engine import generate, make_method
    from engine_fixtures import prompt

    tm, d, eng = _setup(arch, torch.bfloat16, seed=1, variant=variant)
    equal = total = 0
    for seed in range(4):
        p = prompt(tm.vocab_size, 9, seed=100 + seed)
        ar = generate(tm, None, p, 32).tokens
        for name, b in [("ar", None), ("dflash", None), ("ddtree", 16), ("ddtree", 256)]:
            m = make_method(name, tm, d, b)
            equal += generate(tm, m, p, 32, engine=eng).tokens == ar
            total += 1
    print(f"bf16 {arch}: captured == eager AR on {equal}/{total} generations")
    assert equal >= total * 2 // 3


def test_captured_size_errors() -> None:
    from draftforge.engine import CapacityError, generate, make_method
    from draftforge.engine.graph import BucketError
    from engine_fixtures import prompt

    tm, d, eng = _setup("Qwen3ForCausalLM", torch.float32)
    p = prompt(tm.vocab_size, 9)
    with pytest.raises(BucketError, match="not a captured bucket"):
        generate(tm, make_method("ddtree", tm, d, 32), p, 8, engine=eng)
    with pytest.raises(CapacityError, match="longer than the fixed capacity"):
        generate(tm, None, prompt(tm.vocab_size, eng.capacity + 1), 8, engine=eng)
    with pytest.raises(CapacityError, match="exceed the fixed capacity"):
        generate(tm, make_method("ddtree", tm, d, 256), p, eng.capacity, engine=eng)
    assert generate(tm, None, p, 8, engine=eng).tokens == generate(tm, None, p, 8).tokens  # still usable


@pytest.mark.parametrize("heads", [(32, 8, 128), (24, 4, 256)], ids=["qwen3-8b", "qwen3.6-27b"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_attention_matches_sdpa_on_cuda(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    """The split-KV kernel against the folded SDPA at real head shapes (the 256-wide head needs smaller
    tiles to fit shared memory): AR step, chain, tree spans."""
    from draftforge.engine.blocks import attend
    from draftforge.engine.split_attention import combine_splits, split_partials, usable

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, hd = heads
    cap = 2048
    for n, kv_len in ((1, 700), (16, 1500), (17, 1600), (65, 2048)):
        q = torch.randn(1, hq, n, hd, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(hkv, cap, hd, device="cuda", dtype=dtype, generator=g) for _ in range(2))
        past = kv_len - n
        vis = torch.zeros(n, cap, dtype=torch.bool, device="cuda")
        vis[:, :past] = True
        vis[:, past:kv_len] = torch.tril(torch.rand(n, n, device="cuda", generator=g) < 0.5) | torch.eye(
            n, dtype=torch.bool, device="cuda")
        mask = torch.zeros((), device="cuda", dtype=dtype).masked_fill(~vis, float("-inf")).repeat(hq // hkv, 1)
        assert usable(q, (hq // hkv) * n, hkv)  # each span here is one the engine sends to the split kernel
        ref = attend(q, k[None], v[None], mask[None, None], False, hd**-0.5).float()
        kv = torch.tensor([kv_len], device="cuda")
        out = combine_splits(*split_partials(q, k, v, mask[None, None], kv, hd**-0.5), n, dtype).float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out - ref).abs().max().item() < tol * ref.abs().max().item(), (n, dtype)
